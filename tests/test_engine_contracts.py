"""nvckpt's engines against the engine contract (nvckpt.testing.engines): the CPU engine, and the GPU engine's
scheduling on its host stand-in (on a GPU, tests/test_gpu.py runs the CUDA backend)."""

from __future__ import annotations

from nvckpt.engines.cpu import CpuEngine
from nvckpt.engines.gpu.engine import GpuEngine
from nvckpt.testing.engines import EngineTests
from nvckpt.testing.host import HostBackend


class TestCpuEngine(EngineTests):
    def engine(self):
        return CpuEngine()


class TestGpuEngineOnTheHost(EngineTests):
    def engine(self):
        return GpuEngine(backend=HostBackend())
