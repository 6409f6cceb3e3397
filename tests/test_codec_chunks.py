"""The codecs walk a buffer a chunk at a time (:data:`minizero.compress.codec.CHUNK`, for speed: issue 48), and sum
decoded messages straight into a buffer (``add_decoded``).  Neither may change a bit: a buffer of many chunks
is coded as one chunk codes it -- no block, byte or index cut or shifted at a chunk's edge -- and adding a
message is adding its decoded values.  Top-k finds its k largest from a sample's threshold, so it is checked
where the sample misses them, and with NaN (which ``torch.topk`` counts as largest)."""
from __future__ import annotations

import pytest
import torch

import minizero.compress.codec as codec_module
from minizero.compress import parse
from minizero.compress.codec import from_bytes
from minizero.compress.topk import SAMPLE, largest

SPECS = ["int8", "int4", "int8:block=3", "int4:block=5", "int8:block=7,stochastic=1", "int4:block=16,stochastic=1",
         "fp8", "fp8:format=e5m2,block=5", "topk:0.01", "topk:0.3", "sign"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def coded(spec: str, x: torch.Tensor, chunk: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(codec_module, "CHUNK", chunk)
    codec = parse(spec)
    message = codec.encode(x, torch.Generator().manual_seed(7) if codec.stochastic else None)
    return message, codec.decode(message, x.numel(), x.dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [999, 1000, 1001])
def test_a_buffer_of_many_chunks_is_coded_bit_for_bit_as_one_chunk_codes_it(spec, dtype, numel, monkeypatch):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    x[::97] = 0.0
    whole = coded(spec, x, 1 << 30, monkeypatch)
    for chunk in (8, 64, 250):  # a block of 3, 5 or 7 never divides these: chunks are rounded to whole blocks
        message, decoded = coded(spec, x, chunk, monkeypatch)
        if spec == "sign":  # its scale, the mean magnitude, is summed a chunk at a time: its last bits may differ
            signs = -(x.numel() // -8)
            assert torch.equal(message[:signs], whole[0][:signs]), f"{dtype}, chunks of {chunk}: other signs"
            scale, want = (from_bytes(m[signs:], dtype).double() for m in (message, whole[0]))
            assert torch.allclose(scale, want, rtol=1e-6, atol=0), f"{dtype}, chunks of {chunk}: {scale} != {want}"
            continue
        assert torch.equal(message, whole[0]), f"{spec}, {dtype}, chunks of {chunk}: another message"
        assert torch.equal(decoded, whole[1]), f"{spec}, {dtype}, chunks of {chunk}: decoded otherwise"


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adding_a_message_adds_its_decoded_values(spec, dtype, monkeypatch):
    monkeypatch.setattr(codec_module, "CHUNK", 64)
    codec = parse(spec)
    x, total = (torch.randn(2, 777, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    message = codec.encode(x, torch.Generator().manual_seed(3) if codec.stochastic else None)
    want = total + codec.decode(message, x.numel(), dtype)
    got = codec.add_decoded(message, total.clone())
    assert torch.equal(got, want), (spec, dtype, (got - want).abs().max())


def same_magnitudes(x: torch.Tensor, index: torch.Tensor, k: int) -> bool:
    """``index`` holds k distinct positions, sorted, whose magnitudes are the k largest (NaN largest)."""
    want = torch.topk(x.abs(), k).values
    got = torch.topk(x[index].abs(), k).values
    return (index.numel() == k and bool((index[1:] > index[:-1]).all())
            and torch.equal(got.nan_to_num(posinf=1e300), want.nan_to_num(posinf=1e300)))


@pytest.mark.parametrize("chunk", [1 << 18, 1000])
def test_topk_finds_the_k_largest_where_its_sample_sees_them_and_where_it_misses_them(chunk, monkeypatch):
    monkeypatch.setattr(codec_module, "CHUNK", chunk)
    numel = 40 * SAMPLE + 3
    stride = numel // SAMPLE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=generator)
    for k in (1, 10, numel // 100, numel // 5):
        assert same_magnitudes(x, largest(x, k), k), f"k={k}: not the k largest"
    hidden = x.clone()  # the sample sees only the largest values, so its threshold is above every other one...
    hidden[::stride] = 100 + torch.rand(hidden[::stride].shape, generator=generator)
    k = 2 * hidden[::stride].numel()  # ... and k is more than those: the rest must be found without it
    assert same_magnitudes(hidden, largest(hidden, k), k), "the sample's threshold hid some of the largest"
    hidden = x.clone()  # the largest only where the sample never looks
    hidden[1::stride] = 100 + torch.rand(hidden[1::stride].shape, generator=generator)
    k = hidden[1::stride].numel() // 2
    assert same_magnitudes(hidden, largest(hidden, k), k), "the sample missed the largest and so did top-k"
    for bad in (float("nan"), float("inf"), -float("inf")):
        x_bad = x.clone()
        x_bad[5 * stride + 1] = bad
        index = largest(x_bad, 10)
        assert 5 * stride + 1 in index.tolist(), f"{bad} at an unsampled place is not among the largest"
        assert same_magnitudes(x_bad, index, 10)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_empty_buffer_codes_to_an_empty_one(spec, dtype):
    codec = parse(spec)
    x = torch.empty(0, dtype=dtype)
    message = codec.encode(x, torch.Generator().manual_seed(0) if codec.stochastic else None)
    assert message.numel() == codec.message_bytes(0, dtype)
    assert codec.decode(message, 0, dtype).numel() == 0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_value_that_is_not_finite_never_decodes_to_finite_values_only(spec, bad, monkeypatch):
    """The wire refuses a mean that is not finite (the weights untouched): a codec that turned an inf or a NaN into
    finite numbers would make that a silent wrong answer.  In every chunk of a many-chunk buffer."""
    monkeypatch.setattr(codec_module, "CHUNK", 64)
    codec = parse(spec)
    for at in (0, 200, 999):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(at))
        x[at] = bad
        message = codec.encode(x, torch.Generator().manual_seed(1) if codec.stochastic else None)
        assert not torch.isfinite(codec.decode(message, x.numel(), x.dtype)).all(), f"{spec}: {bad} at {at} lost"
