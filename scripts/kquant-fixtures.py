#!/usr/bin/env python3
"""Writes tests/fixtures/kquants/: random K-quant (and Q5_0/Q5_1) blocks dequantized by an
independent reference.

The reference is the PyPI `gguf` package's NumPy implementation (`gguf.quants.dequantize`),
pinned below; kvgate's `kernels/tests/kquant_conformance.rs` compares its own dequantization
with these files bit for bit. The package has no Q8_K quantizer, so Q8_K fixtures come from a
NumPy transcription of ggml's `quantize_row_q8_K_ref` in this file (float32 throughout, as C).

Requirements (pinned; reruns must give byte-identical files):
    gguf==0.19.0
    numpy==2.4.6

Run:
    python3 -m venv /work/cache/gguf-venv
    /work/cache/gguf-venv/bin/pip install gguf==0.19.0 numpy==2.4.6
    /work/cache/gguf-venv/bin/python scripts/kquant-fixtures.py

Files per type T in {q4_k, q5_k, q6_k, q5_0, q5_1}: T.blocks (raw blocks, ggml layout) and
T.f32 (the dequantized values, little-endian f32). Q5_0/Q5_1 draw from their own generator so
that adding them left the K-quant files byte-identical. For Q8_K: q8_k.in.f32 (input values) and q8_k.blocks
(292-byte blocks: f32 d, 256 int8, 16 int16 bsums).
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

QK_K = 256
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "kquants"
BLOCKS = 8

# (type, block bytes, offsets of the f16 super-block scales inside a block)
TYPES = [
    ("q4_k", GGMLQuantizationType.Q4_K, 144, [0, 2]),
    ("q5_k", GGMLQuantizationType.Q5_K, 176, [0, 2]),
    ("q6_k", GGMLQuantizationType.Q6_K, 210, [208]),
]


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite f16 bit patterns over the whole range: normals, subnormals, zeros, both
    signs (exponent 0x1F, inf/NaN, excluded: ggml files never hold them)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    bits[bad] &= 0xBFFF  # clear the exponent's top bit: finite
    return bits


def kquant_blocks(rng: np.random.Generator, size: int, scale_offsets: list[int]) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint16).astype(np.uint8)
    for off in scale_offsets:
        # Half the blocks get realistic scales (|d| < 0.05), half any finite f16.
        wide = random_f16(rng, BLOCKS)
        small = np.float16(rng.uniform(-0.05, 0.05, size=BLOCKS)).view(np.uint16)
        bits = np.where(np.arange(BLOCKS) % 2 == 0, small, wide).astype("<u2")
        blocks[:, off : off + 2] = bits.view(np.uint8).reshape(BLOCKS, 2)
    # Edge blocks: all-zero fields, and all-ones quant/scale bytes with the realistic scales.
    blocks[BLOCKS - 1, :] = 0
    ones = np.full(size, 0xFF, dtype=np.uint8)
    for off in scale_offsets:
        ones[off : off + 2] = blocks[0, off : off + 2]
    blocks[BLOCKS - 2, :] = ones
    return blocks


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref on float32 rows of 256."""
    out = bytearray()
    for row in x.reshape(-1, QK_K):
        amax_at = int(np.argmax(np.abs(row)))  # the first of equal magnitudes, as ggml's `>`
        vmax = row[amax_at]
        if vmax == 0:
            out += bytes(4 + QK_K + 32)
            continue
        iscale = np.float32(-127.0) / vmax
        q = np.minimum(np.rint(iscale * row), np.float32(127)).astype(np.int8)
        bsums = q.astype(np.int16).reshape(16, 16).sum(axis=1).astype("<i2")
        out += (np.float32(1.0) / iscale).astype("<f4").tobytes()
        out += q.tobytes()
        out += bsums.tobytes()
    return np.frombuffer(bytes(out), dtype=np.uint8)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261201)
    for name, qtype, size, scale_offsets in TYPES:
        blocks = kquant_blocks(rng, size, scale_offsets)
        values = dequantize(blocks.reshape(-1), qtype).astype("<f4")
        assert values.shape == (BLOCKS * QK_K,), values.shape
        (OUT / f"{name}.blocks").write_bytes(blocks.tobytes())
        (OUT / f"{name}.f32").write_bytes(values.tobytes())

    # Q8_K: random magnitudes, a block whose extreme is positive, one all-zero block, one with
    # exact halves (max = -127 makes iscale 1) to pin round-half-to-even.
    x = rng.standard_normal((4, QK_K)).astype(np.float32) * np.float32(3.0)
    x[1, 17] = np.float32(50.0)
    x[2, :] = 0
    x[3, :] = np.float32(0.5) * rng.integers(-200, 201, size=QK_K).astype(np.float32)
    x[3, 9] = np.float32(-127.0)
    x[3, 10:20] = np.float32(126.5)
    x = x.reshape(-1).astype("<f4")
    (OUT / "q8_k.in.f32").write_bytes(x.tobytes())
    (OUT / "q8_k.blocks").write_bytes(quantize_q8_k(x).tobytes())

    # Q5_0 (d, qh, qs) and Q5_1 (d, m, qh, qs): 32-value blocks, BLOCKS of each.
    rng = np.random.default_rng(2026120105)
    for name, qtype, size, scale_offsets in [
        ("q5_0", GGMLQuantizationType.Q5_0, 22, [0]),
        ("q5_1", GGMLQuantizationType.Q5_1, 24, [0, 2]),
    ]:
        blocks = kquant_blocks(rng, size, scale_offsets)
        values = dequantize(blocks.reshape(-1), qtype).astype("<f4")
        assert values.shape == (BLOCKS * 32,), values.shape
        (OUT / f"{name}.blocks").write_bytes(blocks.tobytes())
        (OUT / f"{name}.f32").write_bytes(values.tobytes())


if __name__ == "__main__":
    main()
