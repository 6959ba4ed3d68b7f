"""Teacher-forced agreement: exact for the unpruned path, below 1 when pruning changes the
model's predictions."""

import numpy as np

from mlx_lazy import PruningConfig
from mlx_lazy.bench import fidelity
from mlx_lazy.bench.speed import build_prompt


def test_agreement_is_exact_for_full_and_drops_under_heavy_pruning(tiny_model):
    model, tokenizer = tiny_model("llama")
    prompt = build_prompt(tokenizer, 200)
    assert len(prompt) == 200 and prompt != build_prompt(tokenizer, 200, offset=37)
    ref = fidelity.greedy_tokens(model, prompt, 8)
    assert fidelity.agreement(model, PruningConfig("full"), prompt, ref) == [True] * 8
    dropped = fidelity.agreement(model, PruningConfig("random", keep=(0.05,)), prompt, ref)
    assert len(dropped) == 8 and np.mean(dropped) < 1


def test_references_and_summary(tiny_model):
    model, tokenizer = tiny_model("llama")
    refs = fidelity.references(model, tokenizer, 120, 2, 5)
    assert [len(p) for p, _ in refs] == [120, 120] and refs[0][0] != refs[1][0]
    assert all(r == fidelity.greedy_tokens(model, p, 5) for p, r in refs)
    config = PruningConfig("random", keep=(0.05,))
    hits = [h for p, r in refs for h in fidelity.agreement(model, config, p, r)]
    summary = fidelity.agreement_summary(model, config, refs)
    assert (summary["steps"], summary["agree"]) == (10, sum(hits))
    assert summary["rate"] == sum(hits) / 10 and summary["ci"][0] <= summary["rate"]
    assert fidelity.agreement_summary(model, PruningConfig("full"), refs)["rate"] == 1.0
