"""The Megatron trainer's checkpoint format, kept importable here: it lives in
:mod:`chatlearn.checkpoint.megatron_format` (a file format, which ``chatlearn merge`` reads
without importing a trainer)."""
from chatlearn.checkpoint.megatron_format import (  # noqa: F401
    FORMAT,
    LAYOUT_KEYS,
    VERSION,
    read_meta,
    rank_file,
    write_meta,
)
