"""Layer skipping: write a GGUF that keeps a chosen subset of the target's transformer blocks.

The output is a plain GGUF of the same architecture with fewer blocks: every metadata key is
copied (so the tokenizer, and with it the tokenizer fingerprint, is the target's), the block
count is set, the global tensors (token_embd, output_norm, output) are copied, and the kept
`blk.{i}.*` tensors are renumbered to blk.0..N-1. Tensor data is copied as raw bytes, so quantized
weights are not touched. This is self-speculative decoding without retraining (Draft & Verify,
Zhang et al. 2023, arXiv 2309.08168).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from gguf import GGUFReader, GGUFWriter

log = logging.getLogger(__name__)

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def parse_blocks(spec: str, n_blocks: int | None = None) -> list[int]:
    """'0-3,7,10-11' -> [0, 1, 2, 3, 7, 10, 11] (sorted, unique). Ranges are inclusive."""
    out: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad block list {spec!r}: use numbers and ranges like 0-3,7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"bad block range {part!r} in {spec!r}")
        out.update(range(lo, hi + 1))
    if n_blocks is not None and out and max(out) >= n_blocks:
        raise ValueError(f"block {max(out)} does not exist: the model has blocks 0-{n_blocks - 1}")
    return sorted(out)


def format_blocks(blocks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3,7' (the inverse of parse_blocks)."""
    blocks = sorted(set(blocks))
    parts, i = [], 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
            j += 1
        parts.append(str(blocks[i]) if i == j else f"{blocks[i]}-{blocks[j]}")
        i = j + 1
    return ",".join(parts)


class GGUFSource:
    """A GGUF file opened once for many layer-subset writes.

    Parsing the metadata with gguf-py is the slow part (it grows with the vocabulary), so it is
    done here once; each write then costs only the byte copy.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        arch_field = self.reader.fields.get("general.architecture")
        if arch_field is None:
            raise ValueError(f"{self.path} has no general.architecture; not a model GGUF")
        self.arch = str(arch_field.contents())
        self.block_count_key = f"{self.arch}.block_count"
        if self.block_count_key not in self.reader.fields:
            raise ValueError(f"{self.path} has no {self.block_count_key}")
        self.n_blocks = int(self.reader.fields[self.block_count_key].contents())
        # (key, value, type, sub_type) for every key the writer does not set itself.
        self._kv = []
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            sub_type = field.types[1] if len(field.types) > 1 else None
            if len(field.types) > 2:
                # Nested arrays do not occur in llama.cpp models; refuse rather than write garbage.
                raise ValueError(f"{self.path}: metadata key {key} is a nested array, which is not supported")
            self._kv.append((key, field.contents(), field.types[0], sub_type))
        per_block: dict[int, int] = {}
        for t in self.reader.tensors:
            m = _BLOCK_RE.match(t.name)
            if m:
                per_block[int(m.group(1))] = per_block.get(int(m.group(1)), 0) + 1
        if sorted(per_block) != list(range(self.n_blocks)):
            raise ValueError(f"{self.path}: {self.block_count_key} is {self.n_blocks} but the tensors cover "
                             f"blocks {format_blocks(per_block)}")

    def write_subset(self, out: str | os.PathLike, keep: Sequence[int],
                     extra_kv: dict[str, str] | None = None) -> Path:
        """Write `out` with only the blocks in `keep` (original ids), renumbered in order."""
        keep = sorted(set(keep))
        if not keep:
            raise ValueError("keep at least one block")
        if keep[0] < 0 or keep[-1] >= self.n_blocks:
            raise ValueError(f"blocks must be in 0-{self.n_blocks - 1}, got {format_blocks(keep)}")
        new_id = {old: new for new, old in enumerate(keep)}
        out = Path(out)
        # Write next to the final name, then rename: a crash never leaves a half-written draft.
        tmp = out.with_name(out.name + ".part")
        writer = GGUFWriter(tmp, self.arch)
        for key, value, vtype, sub_type in self._kv:
            if key == self.block_count_key:
                value = len(keep)
            elif key == "general.alignment":
                writer.data_alignment = int(value)  # the copied key must match the padding we write
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
        for key, value in (extra_kv or {}).items():
            writer.add_string(key, value)

        chosen = []  # (new name, reader tensor)
        for t in self.reader.tensors:
            m = _BLOCK_RE.match(t.name)
            if m is None:
                chosen.append((t.name, t))
            elif int(m.group(1)) in new_id:
                chosen.append((f"blk.{new_id[int(m.group(1))]}.{m.group(2)}", t))
        for name, t in chosen:
            # t.data is the raw on-disk array (uint8 rows for quantized types); raw_dtype keeps the type.
            writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, t in chosen:
                writer.write_tensor_data(t.data)
            writer.close()
            os.replace(tmp, out)
        except BaseException:
            writer.close()
            tmp.unlink(missing_ok=True)
            raise
        log.debug("wrote %s with blocks %s of %d", out, format_blocks(keep), self.n_blocks)
        return out


def skip_layers(target: str | os.PathLike, out: str | os.PathLike, keep: Sequence[int]) -> Path:
    """One-shot layer subset (opens the target, writes `out`)."""
    return GGUFSource(target).write_subset(out, keep)
