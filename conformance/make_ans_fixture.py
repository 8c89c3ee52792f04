#!/usr/bin/env python3
"""Make conformance/fixtures/ans_chunk.json: one genuine nvCOMP ANS chunk for the suite.

Runs only where there is a CUDA GPU and nvCOMP >= 6 (``pip install nvidia-nvcomp-cu12``).
It compresses a fixed bfloat16 tensor (64 x 128, seed 77) as ONE chunk with
nvCOMP's low-level batched ANS compressor, RAW bitstream (no nvCOMP container
header), data type ``<f2`` -- exactly what SPEC.md 11.6 calls ``nvcomp-ans`` --
decompresses it again on the GPU to check the round trip, and writes the raw
and stored bytes (hex) with the nvCOMP version and GPU that produced them.

tools/gen_conformance.py splices the stored bytes into the suite's
``valid-codec-nvcomp-ans`` and ``valid-nvcomp-ans-old-bitstream`` cases.  The
bytes come from nvCOMP itself, called directly through its Python API
(``nvidia.nvcomp.Codec``), not through nvckpt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import xxhash

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "ans_chunk.json")


def main() -> int:
    import nvidia.nvcomp as nv

    g = torch.Generator().manual_seed(77)
    x = (torch.randn(64, 128, generator=g) * 0.05).to(torch.bfloat16)  # weight-like values
    raw = x.view(torch.uint8).reshape(-1).contiguous()
    stream = torch.cuda.current_stream()
    codec = nv.Codec(algorithm="ANS", bitstream_kind=nv.BitstreamKind.RAW, data_type="<f2", device_id=0,
                     cuda_stream=stream.cuda_stream)
    src = raw.cuda()
    cap = int(codec.get_max_comp_buffer_size(nv.as_array(src, stream.cuda_stream)))
    # Zeroed: nvCOMP ANS may leave bytes inside the reported length unwritten; zeros keep the bytes reproducible.
    out = torch.zeros(-(-cap // 16) * 16, dtype=torch.uint8, device="cuda")
    result = codec.encode(nv.as_arrays([src], stream.cuda_stream), out=nv.as_arrays([out], stream.cuda_stream))
    size = int(list(result.buffer_sizes)[0])
    del result
    stored = out[:size].clone()

    # Round trip on the GPU.
    back = torch.zeros(raw.numel(), dtype=torch.uint8, device="cuda")
    decoded = codec.decode(nv.as_arrays([stored], stream.cuda_stream), out=nv.as_arrays([back], stream.cuda_stream))
    got = int(list(decoded.buffer_sizes)[0])
    del decoded
    torch.cuda.synchronize()
    if got != raw.numel() or not torch.equal(back.cpu(), raw):
        print(f"round trip failed: {got} bytes", file=sys.stderr)
        return 1

    version = ".".join(str(nv.__version__).split(".")[:3])
    raw_b, stored_b = raw.numpy().tobytes(), stored.cpu().numpy().tobytes()
    fixture = {
        "what": "one nvcomp-ans chunk (SPEC.md 11.6): nvCOMP ANS, RAW bitstream, data_type <f2",
        "produced_by": f"nvidia.nvcomp {nv.__version__} Codec(algorithm='ANS', bitstream_kind=RAW, data_type='<f2')"
                       f".encode on {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "nvcomp_version": version,
        "data_type": "<f2",
        "dtype": "bfloat16",
        "shape": [64, 128],
        "raw_sha256": hashlib.sha256(raw_b).hexdigest(),
        "stored_xxh3": xxhash.xxh3_64_intdigest(stored_b),
        "raw_hex": raw_b.hex(),
        "stored_hex": stored_b.hex(),
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"{len(raw_b)} raw bytes -> {len(stored_b)} ANS bytes (nvCOMP {nv.__version__}), round trip ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
