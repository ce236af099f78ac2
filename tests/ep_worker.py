"""One rank of tests/test_distributed.py, started by `mlx.launch`: writes what it found to OUT/rank{r}.json.

    decode OUT [PATH] the model at PATH (default the bundled one), expert-parallel over the group: each MoE layer
                      against the whole model loaded in this same process, and the tokens of greedy, sampled and
                      "auto" generations, and of a raw Conversation's turns
    load OUT PATH...  qmtp.load(PATH[rank], group=...): the DistributedError it raises, if any
"""

import json
import sys
from pathlib import Path

import mlx.core as mx

import qmtp
from qmtp.parallel import DistributedError

PROMPT = "Once upon a time"
MAX_TOKENS = 24
SEED = 3
CONVERSATION = [PROMPT, " The fox said", " and the hare"]


def moe_layers_equal(whole, sharded) -> dict:
    """Each MoE layer (trunk and head) of the sharded model against the whole one, on random inputs of a few
    lengths (1 token as in decoding, 3 and 6 as in verify passes, 40 as in a prefill: the sorted path)."""
    mx.random.seed(1)
    H = whole.config.hidden_size
    pairs = [(a.mlp, b.mlp) for a, b in zip(whole.layers, sharded.layers)]
    pairs.append((whole.mtp.layers[0].mlp, sharded.mtp.layers[0].mlp))
    result = {}
    for tokens in (1, 3, 6, 40):
        x = mx.random.normal((tokens, H)).astype(whole.dtype)
        result[str(tokens)] = [bool(mx.array_equal(a(x), b(x)).item()) for a, b in pairs]
    return result


def decode(out: Path, group, path=None) -> dict:
    whole = qmtp.load(path)
    sharded = qmtp.load(path, group=group)
    found = {"held": list(sharded.layers[0].mlp.experts.gate_proj.weight.shape),
             "moe_equal": moe_layers_equal(whole, sharded), "tokens": {}}
    for n_draft in (1, 2, 3, 4, 5):
        for temperature in (0.0, 0.8):
            g = qmtp.generate(sharded, PROMPT, max_tokens=MAX_TOKENS, n_draft=n_draft, temperature=temperature,
                              seed=SEED)
            found["tokens"][f"{n_draft}/{temperature}"] = g.tokens
    for temperature in (0.0, 0.8):
        g = qmtp.generate(sharded, PROMPT, max_tokens=MAX_TOKENS, n_draft="auto", temperature=temperature, seed=SEED)
        found["tokens"][f"auto/{temperature}"] = g.tokens
        found[f"auto_widths/{temperature}"] = g.stats.tokens_per_pass
        # the step costs each rank learned while decoding: rank 0's intervals, fed to every rank's planner
        found[f"auto_costs/{temperature}"] = [sorted(c.measured().items())
                                              for by_rows in sharded.__dict__["_step_costs"].values()
                                              for c in by_rows.values()]
    # a conversation over raw ids: each turn resumes the state the last one left, on every rank alike
    for temperature in (0.0, 0.8):
        conversation = qmtp.Conversation(sharded, raw=True, n_draft=3, temperature=temperature, seed=SEED,
                                         max_tokens=MAX_TOKENS)
        found[f"conversation/{temperature}"] = [
            {"prompt": g.prompt_tokens, "tokens": g.tokens, "prefilled": g.stats.prefilled_tokens}
            for g in (conversation.send(text) for text in CONVERSATION)]
    return found


def load(paths: list[str], group) -> dict:
    try:
        qmtp.load(paths[group.rank()], group=group)
    except DistributedError as err:
        return {"error": str(err)}
    return {"error": None}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    group = mx.distributed.init(strict=True)
    found = decode(out, group, *sys.argv[3:4]) if mode == "decode" else load(sys.argv[3:], group)
    found["rank"], found["size"] = group.rank(), group.size()
    (out / f"rank{group.rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
