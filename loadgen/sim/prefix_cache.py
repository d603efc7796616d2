"""Prompt block hashes for the simulated engine's prefix cache (pure).

vLLM hashes each *full* block of ``block_size`` prompt tokens chained over the blocks before it:
``hash_i = H((hash_{i-1}, tuple(token_ids of block i), extra_keys))`` with ``hash_{-1}`` a fixed
seed (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``), so two prompts share cached block
i exactly when their first ``(i + 1) * block_size`` tokens are equal. The simulator uses Python's
``hash`` of the same tuple (deterministic for ints and tuples of ints; vLLM's default is sha256,
which only changes the collision odds).

Two sources of block contents:

- :func:`block_hashes_from_tokens`: real token ids (the real-time server, which tokenizes prompts).
- :func:`block_hashes_from_ids`: traces that give only ids of coarse prefix blocks (Mooncake FAST'25
  ``hash_ids``: one id per 512-token block, equal leading ids = equal prompt prefix). Engine block
  j of a prompt lies in trace block ``k = j * block_size // id_block_tokens``; its content key is
  ``(hash_ids[k], offset of j inside block k)``, chained like vLLM's, so equal leading ``hash_ids``
  give equal leading engine-block hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x5EED_B10C
"""Parent hash of a prompt's first block (vLLM's ``NONE_HASH``)."""


def chain_hashes(contents: Sequence[object]) -> list[int]:
    """``h_i = hash((h_{i-1}, contents[i]))`` with ``h_{-1} = ROOT_HASH``, for every i (module docstring)."""
    out = []
    h = ROOT_HASH
    for c in contents:
        h = hash((h, c))
        out.append(h)
    return out


def block_hashes_from_tokens(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids`` (a partial last block has none).

    Raises:
        ValueError: if ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(token_ids) // block_size
    return chain_hashes([tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(full)])


def block_hashes_from_bytes(data: bytes, bytes_per_token: int, block_size: int) -> list[int]:
    """Chained hashes of the full blocks of a prompt whose tokens are fixed-size byte pieces (the
    simulated tokenizer: one token per ``bytes_per_token`` bytes), hashing each block's bytes:
    equal bytes = equal token ids, so the hashes agree with :func:`block_hashes_from_tokens`'s
    equality without building the ids.

    Raises:
        ValueError: if ``bytes_per_token`` or ``block_size`` < 1.
    """
    if bytes_per_token < 1 or block_size < 1:
        raise ValueError(f"bytes_per_token and block_size must be >= 1, got {bytes_per_token}, {block_size}")
    step = bytes_per_token * block_size
    return chain_hashes([data[i * step:(i + 1) * step] for i in range(len(data) // step)])


def block_hashes_from_ids(hash_ids: Sequence[int], id_block_tokens: int, block_size: int, prompt_tokens: int) -> list[int]:
    """Chained hashes of the full engine blocks of a prompt described by coarse prefix-block ids.

    Args:
        hash_ids: one id per ``id_block_tokens`` tokens of the prompt, in order (the last may be partial).
        id_block_tokens: tokens per id (512 in Mooncake), a multiple of ``block_size``.
        block_size: engine block size (tokens).
        prompt_tokens: prompt length (tokens); blocks past ``len(hash_ids) * id_block_tokens`` have
            no content id and get no hash (they can never hit).

    Returns:
        ``min(prompt_tokens, len(hash_ids) * id_block_tokens) // block_size`` hashes.

    Raises:
        ValueError: if ``id_block_tokens`` is not a positive multiple of ``block_size``.
    """
    if block_size < 1 or id_block_tokens < block_size or id_block_tokens % block_size:
        raise ValueError(f"id_block_tokens ({id_block_tokens}) must be a positive multiple of block_size ({block_size})")
    per = id_block_tokens // block_size
    full = min(prompt_tokens, len(hash_ids) * id_block_tokens) // block_size
    return chain_hashes([(hash_ids[j // per], j % per) for j in range(full)])
