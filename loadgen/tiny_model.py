"""Build a tiny random-weight Llama and its offline tokenizer, for real vLLM on CPU without a model hub.

Run with the vLLM venv's interpreter (it has ``transformers``, ``tokenizers``, ``torch``; the main
venv does not)::

    .venv-vllm/bin/python -m loadgen.tiny_model .cache/tiny-llama
    .venv-vllm/bin/python -m loadgen.tiny_model .cache/bench-llama --size bench

Sizes (:data:`SIZES`): ``tiny`` (the default, for functional tests: a step is almost all vLLM overhead)
and ``bench`` (for ``make bench-vllm``: big enough that batch formation matters on one CPU core, see
:data:`SIZES`).

The result (about 2 MB) loads in vLLM as ``LlamaForCausalLM``: a byte-level BPE tokenizer trained on a
few sentences (vocab about 900, specials ``<s> </s> <unk> <pad>``, a template that prepends ``<s>``, a
trivial chat template) and a 2-layer Llama with hidden size 128 in float32 safetensors. The text it
generates is random; it is meant for functional and routing tests, not for quality or speed figures.
Everything is seeded, so two builds give the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB_SIZE = 900
SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

# A small corpus: enough byte pairs to reach the vocabulary size, no download needed.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A router sends each request to the replica with the most admission budget left.",
    "The replica agent predicts how many prefill tokens fit before the next token deadline.",
    "Large language models generate text one token at a time after reading the whole prompt.",
    "Service level objectives bound the time to the first token and the time per output token.",
    "Continuous batching mixes prefills and decodes of many requests in every engine step.",
    "Paged attention keeps the key value cache in fixed size blocks of GPU memory.",
    "When memory runs out the scheduler preempts the most recent request and recomputes it later.",
    "Tenants share the fleet with weights, and a fair queue orders waiting requests by weight.",
    "Hello, how are you today? I am fine, thank you. What would you like to know?",
    "Write a short poem about the sea, the wind, the stars and the long night.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000 2024 3.14 2.71.",
    "Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? , ; : ' \" # @ $ _",
    "def main(argv): return 0  # code also appears in prompts",
    "Summarise the following document in three sentences and list its key points.",
    "Translate to French: the cat sits on the mat while the dog sleeps by the door.",
    "Explain why the sky is blue, why water is wet, and why bread rises in a warm oven.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June.",
    "Please answer with a list of steps: open the file, read every line, count the words, close it.",
    "The history of computing spans mechanical calculators, vacuum tubes, transistors and chips.",
    "Kubernetes schedules pods onto nodes; a sidecar container runs next to the main container.",
    "Prometheus scrapes metrics over HTTP; gauges go up and down while counters only increase.",
]


# The simulated engine's prompt words (loadgen/sim/tokenizer.py); with these in the corpus, BPE
# learns one token per word, so a loadgen prompt of N "tokens" is about N tokens here too.
_SIM_WORDS = ("the", "and", "for", "was", "you", "are", "not", "but", "can", "all", "one", "had")


def _corpus() -> list[str]:
    lines = []
    for shift in range(len(_SIM_WORDS)):
        words = _SIM_WORDS[shift:] + _SIM_WORDS[:shift]
        lines.append(" ".join(words * 4) + " ")
    for i in range(20):
        for s in _CORPUS:
            lines.append(s if i == 0 else f"{s} {s.lower()} {i}")
    return lines


def build_tokenizer(out_dir: Path) -> object:
    """Train the byte-level BPE tokenizer and save it as a ``PreTrainedTokenizerFast`` in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 2048},
    # about 7.0 M parameters (28 MB in float32), grouped-query attention (6 query heads, 2 KV heads) as in
    # Llama 3: vLLM on one core of the 2-core AVX2 CI machine, with the machine shared (load average
    # 9-12), took 2.0 s for a 2,048-token prefill step and 13 / 49 ms for a decode step of 1 / 32
    # sequences; on a quiet core about a third of that (docs/vllm.md "A CPU-sized workload")
    "bench": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096},
}
"""Model shapes by name (``LlamaConfig`` fields); ``tiny`` is the one the functional tests use."""


def build_tiny_model(out_dir: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write tokenizer + config + random float32 weights (safetensors) to ``out_dir``; return it.

    Args:
        out_dir: folder (created).
        seed: torch seed of the weights (the tokenizer is deterministic).
        size: a key of :data:`SIZES`.

    Raises:
        KeyError: unknown ``size``.
    """
    shape = SIZES[size]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    vocab_size = len(tok)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        **shape,
        bos_token_id=tok.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    # A generation config that does not stop on EOS early is not needed (vLLM ignores it unless asked),
    # but keep it minimal and explicit.
    (out / "fairbatch-tiny-model.json").write_text(
        json.dumps({"builder": "loadgen.tiny_model", "seed": seed, "size": size, "vocab_size": vocab_size,
                    "parameters": sum(p.numel() for p in model.parameters())}, indent=2) + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m loadgen.tiny_model DIR [--seed N] [--size tiny|bench]``."""
    p = argparse.ArgumentParser(prog="python -m loadgen.tiny_model", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="folder to write the model into (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape (default: tiny)")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("loadgen.tiny_model needs transformers/tokenizers/torch: run it with .venv-vllm/bin/python "
              "(make vllm-env)", file=sys.stderr)
        return 2
    out = build_tiny_model(args.out_dir, seed=args.seed, size=args.size)
    files = sorted(f.name for f in out.iterdir())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"tiny model written to {out} ({size / 1e6:.1f} MB): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
