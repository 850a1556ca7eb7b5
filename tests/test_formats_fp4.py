import torch

from hfq.formats import fp4


def test_all_16_codes_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fp4.e2m1_encode(fp4.e2m1_decode(codes)), codes)
    assert torch.equal(fp4.unpack_fp4(fp4.pack_fp4(codes)), codes)
