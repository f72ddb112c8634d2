import numpy as np
import pytest
import scipy.fft
import torch

from flexdemo.compress import BlockDCT, choose_chunk, dct_matrix, plan_chunks, topk_indices


@pytest.mark.parametrize("dim,target,expected", [
    (384, 64, (64, 384)),     # exact divisor
    (1000, 64, (50, 1000)),   # nearest divisor in [32, 128]
    (67, 64, (67, 67)),       # prime, but itself within [t/2, 2t]
    (131, 64, (64, 192)),     # prime beyond 2t: padded, never chunk 1
    (40, 64, (40, 40)),       # smaller than the target: one chunk
    (8191, 64, (64, 8192)),   # large prime
])
def test_choose_chunk(dim, target, expected):
    assert choose_chunk(dim, target) == expected


def test_choose_chunk_never_collapses():
    for dim in range(65, 2000):
        c, p = choose_chunk(dim, 64)
        assert c >= 32 and p % c == 0 and p >= dim and p - dim < c


def test_bad_chunk_target():
    with pytest.raises(ValueError, match="chunk target"):
        choose_chunk(10, 0)


def test_dct_matrix_orthonormal():
    d = dct_matrix(64, torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(64, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(128, 192), (67, 130), (131, 70), (5,), (300,), (131,),
                                   (1, 64), (7, 3, 5), (16, 3, 3, 3)])
def test_round_trip_and_scipy(shape):
    torch.manual_seed(0)
    plan = plan_chunks(shape, 64)
    t = BlockDCT(plan)
    x = torch.randn(shape)
    coef = t.encode(x)
    assert coef.shape == (plan.num_blocks, plan.block_numel)
    torch.testing.assert_close(t.decode(coef.clone()), x, atol=1e-5, rtol=1e-5)
    # every block agrees with scipy's orthonormal DCT-II on the zero-padded tensor
    xp = np.zeros(plan.padded)
    xp[: plan.shape2d[0], : plan.shape2d[1]] = x.reshape(plan.shape2d).double().numpy()
    cr, cc = plan.chunk
    nbr, nbc = plan.grid
    for b in range(plan.num_blocks):
        i, j = divmod(b, nbc)
        block = xp[i * cr:(i + 1) * cr, j * cc:(j + 1) * cc]
        ref = scipy.fft.dctn(block, norm="ortho") if cr > 1 else scipy.fft.dct(block, norm="ortho")
        np.testing.assert_allclose(coef[b].double().numpy().reshape(ref.shape), ref, atol=2e-5)


def test_encode_into_fuses_momentum():
    torch.manual_seed(1)
    plan = plan_chunks((128, 64), 64)
    t = BlockDCT(plan)
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    out = t.encode(x)
    t.encode_into(y, out, alpha=0.5, beta=0.9)
    torch.testing.assert_close(out, 0.9 * t.encode(x) + 0.5 * t.encode(y), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(128, 192), (131, 70), (300,)])
def test_reduced_precision_forward_transform(shape):
    """bf16 products in the forward transform: close to fp32 (about 2^-8 of each block's
    scale), the momentum stays fp32, and the same input gives the same bits."""
    torch.manual_seed(4)
    plan = plan_chunks(shape, 64)
    exact, fast = BlockDCT(plan), BlockDCT(plan, compute_dtype=torch.bfloat16)
    x, y = torch.randn(shape), torch.randn(shape)
    ref = exact.encode(x)
    got = fast.encode(x)
    assert got.dtype == torch.float32
    scale = ref.abs().amax(1, keepdim=True)
    assert bool(((got - ref).abs() <= scale * 2 ** -6).all())
    assert not torch.equal(got, ref)  # it did take the bf16 path
    fast.encode_into(y, got, alpha=0.5, beta=0.9)
    want = 0.9 * ref + 0.5 * exact.encode(y)
    assert bool(((got - want).abs() <= want.abs().amax(1, keepdim=True) * 2 ** -6).all())
    again = fast.encode(x)
    fast.encode_into(y, again, alpha=0.5, beta=0.9)
    assert torch.equal(again, got)
    with pytest.raises(ValueError, match="compute_dtype"):
        BlockDCT(plan, compute_dtype=torch.int8)


def test_image_index_maps_blocks():
    plan = plan_chunks((128, 192), 64)
    t = BlockDCT(plan)
    blocks = torch.randn(plan.num_blocks, plan.block_numel)
    idx = torch.randint(plan.block_numel, (plan.num_blocks, 5))
    image = t.blocks_to_image(blocks).reshape(-1)
    torch.testing.assert_close(image[t.image_index(idx)], blocks.gather(1, idx).reshape(-1))


@pytest.mark.parametrize("k", [32, 16, 4])  # 16 and 4: the groups found in two stages too
def test_topk_matches_torch(k):
    from flexdemo.compress import Scratch

    torch.manual_seed(2)
    m = torch.rand(50, 4096)
    ref = torch.topk(m, k, dim=1).indices.sort(1).values
    assert torch.equal(topk_indices(m, k).sort(1).values, ref)
    assert torch.equal(topk_indices(m, k, Scratch()).sort(1).values, ref)
    with pytest.raises(ValueError, match="topk"):
        topk_indices(m, 0)


@pytest.mark.parametrize("shape,m", [((128, 192), 8), ((128, 192), 32), ((64, 10), 5),
                                     ((1, 256), 16)])
def test_sparse_decode_matches_dense(shape, m):
    torch.manual_seed(3)
    plan = plan_chunks(shape, 64)
    t = BlockDCT(plan)
    idx = torch.stack([torch.randperm(plan.block_numel)[:m] for _ in range(plan.num_blocks)])
    idx = torch.cat([idx, idx[:, :2]], dim=1)  # repeated indices add up
    vals = torch.randn(plan.num_blocks, m + 2)
    dense = torch.zeros(plan.num_blocks, plan.block_numel).scatter_add_(1, idx, vals)
    out = torch.empty(shape)
    t.decode_sparse(idx, vals, out)
    torch.testing.assert_close(out, t.decode(dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cr,cc,k", [(64, 64, 16), (64, 64, 32), (8, 8, 4), (50, 64, 16),
                                     (1, 64, 8)])
def test_rowmajor_topk_matches_block_topk(cr, cc, k):
    """Blocks stored row-major across blocks select the same entries in the same order."""
    from flexdemo.compress import Scratch
    from flexdemo.compress.select import select_rowmajor, topk_blocks_rowmajor

    torch.manual_seed(5)
    nb = 37
    ties = torch.randn(cr, nb, cc)  # blocks of zeros, of -0.0, and half zero: ties to break
    ties[:, :3] = 0.0
    ties[:, 3:6] = -0.0
    ties[: max(1, cr // 2), 6:9] = 0.0
    for coef in (torch.randn(cr, nb, cc), ties):
        blocks = coef.permute(1, 0, 2).reshape(nb, cr * cc)
        ref = topk_indices(blocks.abs(), k)
        idx, pos = topk_blocks_rowmajor(coef, k, torch.empty(coef.numel()), Scratch())
        assert torch.equal(idx, ref)
        assert torch.equal(coef.reshape(-1)[pos], blocks.gather(1, idx))
        if cr % 8 == 0 and cr * cc // 8 >= 4 * k:
            assert all(torch.equal(a, b) for a, b in zip(select_rowmajor(coef, k), (idx, pos)))


@pytest.mark.parametrize("chunk", [(64, 64), (8, 8), (1, 64), (50, 64)])
def test_batched_dct_matches_per_tensor_dct(chunk):
    """Forward and inverse products over a batch of blocks equal the per-tensor transform."""
    from flexdemo.compress.dct import BatchedDCT, block_rows

    torch.manual_seed(6)
    cr, cc = chunk
    shape = (2 * cr, 3 * cc) if cr > 1 else (1, 5 * cc)
    plan = plan_chunks(shape, max(chunk))
    assert plan.chunk == chunk
    one, many = BlockDCT(plan), BatchedDCT(chunk)
    x = torch.randn(shape)
    nb = plan.num_blocks
    rows = x.reshape(-1, cc)[block_rows(plan)].view(nb, cr, cc)  # block layout
    xh = rows.permute(1, 0, 2).contiguous()  # row-major across blocks
    y = many.rows(xh, torch.empty_like(xh))
    coef = torch.zeros_like(xh)
    many.cols_into(y, coef, slice(0, nb), 1.0, 0.0)
    ref = one.encode(x)
    torch.testing.assert_close(coef.permute(1, 0, 2).reshape(nb, -1), ref, atol=1e-5, rtol=1e-5)
    out = torch.empty(nb, cr, cc)
    many.inverse(ref, out, torch.empty(nb * cr * cc))
    torch.testing.assert_close(out, rows, atol=1e-5, rtol=1e-5)
    idx = torch.stack([torch.randperm(cr * cc)[:3] for _ in range(nb)])
    vals = torch.randn(nb, 3)
    sparse = torch.empty(nb, cr, cc)
    many.inverse_sparse(idx, vals, sparse, torch.empty(nb * 3 * cr), torch.empty(nb * 3 * cc))
    dense = torch.zeros(nb, cr * cc).scatter_(1, idx, vals)
    many.inverse(dense, out, torch.empty(nb * cr * cc))
    torch.testing.assert_close(sparse, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [101, 102, 157, 160])
def test_panelled_first_product_gives_the_whole_product_bits(blocks):
    """fp32 on CPU: the first forward product over equal panels of columns (157 blocks: four
    panels of 39.25 blocks; 101: too few for two panels, one product) gives the bits of one
    product over the whole group; bf16 keeps the one product."""
    from flexdemo.compress.dct import _PANEL, BatchedDCT, _panels

    torch.manual_seed(7)
    n = blocks * 64
    assert _panels(n) == (1 if n < 2 * _PANEL else {102: 2, 157: 4, 160: 4}[blocks])
    for dtype in (torch.float32, torch.bfloat16):
        dct = BatchedDCT((64, 64), compute_dtype=dtype)
        x = torch.randn(64, blocks, 64).to(dtype)
        whole = torch.mm(dct._dr_fwd, x.view(64, -1)).view_as(x)
        y = dct.rows(x, torch.full_like(x, float("nan")))
        assert torch.equal(y, whole)
