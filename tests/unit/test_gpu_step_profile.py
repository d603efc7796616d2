"""scripts/gpu_step_profile.py's grid and features (pure; the timed run is tests/vllm/test_gpu_step_profile_torch.py)."""

from __future__ import annotations

from tests.scripts import load_script

gsp = load_script("gpu_step_profile")


def test_point_features_by_hand() -> None:
    # 4 decodes at context 256: new 4, context 1024, 4 seqs, cross 4 * 1 * 256, chunk^2 4 * 1
    assert gsp.point_features([(1, 256)] * 4) == [1.0, 4.0, 1024.0, 4.0, 1024.0, 4.0]
    # a 2048-token chunk over 8192 cached tokens
    assert gsp.point_features([(2048, 8192)]) == [1.0, 2048.0, 8192.0, 1.0, 2048.0 * 8192, 2048.0**2]


def test_grid_stays_within_the_kv_bound_and_covers_every_kind() -> None:
    pts = gsp.grid()
    kinds = {label.split()[0] for label, _ in pts}
    assert kinds == {"prefill", "chunk", "decode"}
    for label, items in pts:
        assert len({tuple(i) for i in items}) == 1, label  # one HF forward: equal sequences
        assert sum(c + p for c, p in items) <= gsp.MAX_CACHE_TOKENS + 8192, label
    assert ("prefill 2048", [(2048, 0)]) in pts and ("decode B=64 ctx 2048", [(1, 2048)] * 64) in pts
    assert all(len(items) * items[0][1] <= gsp.MAX_CACHE_TOKENS for _, items in pts)
    assert len(gsp.grid(tiny=True)) < len(pts)
