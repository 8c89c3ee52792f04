"""Magic numbers, sizes and limits of SPEC.md, in one place."""

PREAMBLE_MAGIC = b"\x89NVCKPT\n"
FRAME_MAGIC = b"NVCF"
FOOTER_MAGIC = b"NVCKEND\n"

VERSION_MAJOR = 1
VERSION_MINOR = 0

PREAMBLE_SIZE = 24
FRAME_HEADER_SIZE = 48
FOOTER_SIZE = 40

# Frame types (SPEC.md, "Frame types").  128..255 are optional extensions a
# reader skips; anything else unknown is an error.
FRAME_CODEC = 1
FRAME_TENSOR = 2
FRAME_CHUNK = 3
FRAME_INDEX = 4
FRAME_NAMES = {FRAME_CODEC: "CODEC", FRAME_TENSOR: "TENSOR", FRAME_CHUNK: "CHUNK", FRAME_INDEX: "INDEX"}
FIRST_OPTIONAL_FRAME = 128

# Feature bits (SPEC 3).  Unknown required bits are fatal.
FEATURE_TYPED_TREE = 1 << 1  # the tree holds ext types 3..8 (SPEC 9.2, version 1.1)
FEATURE_ARRAYS_PATHS = 1 << 2  # the tree holds ext types 9..10: NumPy arrays, paths (SPEC 9.3, version 1.2)
KNOWN_REQUIRED_FEATURES = FEATURE_TYPED_TREE | FEATURE_ARRAYS_PATHS
TYPED_TREE_MINOR = 1  # the version_minor a file with FEATURE_TYPED_TREE declares
ARRAYS_PATHS_MINOR = 2  # the version_minor a file with FEATURE_ARRAYS_PATHS declares

# Limits (SPEC.md, "Limits").
MAX_CHUNK_LENGTH = 16 << 20
MAX_INDEX_LENGTH = 1 << 30
MAX_META_FRAME_LENGTH = 16 << 20  # CODEC and TENSOR frame payloads
MAX_TENSORS = 1 << 24
MAX_RANK = 64
MAX_NAME_BYTES = 4096
MAX_TREE_DEPTH = 64
MAX_PAYLOAD_DEPTH = 72  # SPEC 9, "Parser bound": how deep any msgpack payload nests (its root is level 1)
MAX_CODECS = 0xFFFF
MAX_PADDING = 1 << 20
MAX_ALIGNMENT = 1 << 20
MAX_TENSOR_BYTES = 1 << 62

DEFAULT_ALIGNMENT = 4096  # SPEC 12.3: the alignment a writer uses unless told otherwise

# Tree ext types.
EXT_TENSOR = 1
EXT_TUPLE = 2
# Typed extensions (SPEC 9.2): only in files that set FEATURE_TYPED_TREE.
EXT_DTYPE = 3
EXT_DEVICE = 4
EXT_COMPLEX = 5
EXT_BIGINT = 6
EXT_SET = 7
EXT_FROZENSET = 8
# SPEC 9.3: only in files that set FEATURE_ARRAYS_PATHS.
EXT_NDARRAY = 9  # a tensor reference loaded as a NumPy array
EXT_PATH = 10  # a pathlib path: one flavour byte, then its str in UTF-8
PATH_FLAVOURS = ("PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath")  # ext 10's first byte
# SPEC 10's dtypes that NumPy has no dtype for: an ext 9 never refers to an entry of one (an unknown dtype name
# is unsupported where it is read, as for any tensor).
NON_NUMPY_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                              "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"})
MAX_BIGINT_BYTES = 1024
MAX_TYPE_NAME_BYTES = 64

# Derived tensor functions (SPEC 8.5).
BF16_RNE = "bf16_rne"
COPY = "copy"  # SPEC 14.2: the source's elements, as a tensor of its own
DERIVED_FUNCTIONS = (BF16_RNE, COPY)
