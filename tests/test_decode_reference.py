"""The paper's decode step pinned against a small independent reference.

LazyLLM's step, written out in numpy (float64) from the paper's description for a tiny llama
with one cut: every layer up to the cut computes the new token over every cached key; at
the cut the new token's attention (mean over heads) picks the top ``keep`` fraction of the
context (the anchor and the new token always kept, ties to the lower position); tokens
picked that were pruned earlier are revived from the Aux Cache (their hidden state after
the cut) and, with the new token, go on through the upper layers, each attending to the
picked tokens at or before its own position, each (token, layer) computed once. The engine
must make the same selections, revive the same tokens and give the same logits. With a
``revive_margin`` (beyond the paper), a waiting token's score is divided by 1 + margin; with
``reselect_every`` K (beyond the paper), only every K-th step (counted from the last
selection, the prefill's included) selects, and the steps between see what it chose plus the
tokens generated since, reviving nothing. With ``promote:P`` (beyond the paper), before the
first decode step the best-scoring waiting tokens (by the prompt's last query at the cut) go
through the upper layers in one batch, over every key there, until P% of the context has keys
above the cut, and every step keeps that share.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lazy import LazyEngine, PruningConfig, resolve_config
from numerics import rel_err

CUT, KEEP, PROMPT, STEPS = 1, 0.3, 200, 4
# float32 MLX against a float64 reference through 4 layers of width 64: a few float32
# roundings of logits of size ~1 (a selection that differed would move them by far more).
LOGITS_TOL = 1e-4


class Reference:
    """The tiny llama in numpy with LazyLLM's state: per layer the keys and values by
    position, and the Aux Cache (hidden states waiting at depth ``CUT + 1``)."""

    def __init__(self, model, margin: float = 0.0, every: int = 1, share: float = 0.0):
        self.margin, self.every, self.share = margin, every, share
        self.last_q = None  # the newest token's queries at the cut
        self.held, self.held_at = [], 0  # the last selection and the context length then
        f = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
        m, args = model.model, model.args
        self.embed, self.norm, self.head = (f(m.embed_tokens.weight), f(m.norm.weight),
                                            f(model.lm_head.weight))
        self.layers = [{name: f(w) for name, w in (
            ("ln1", layer.input_layernorm.weight), ("ln2", layer.post_attention_layernorm.weight),
            ("q", layer.self_attn.q_proj.weight), ("k", layer.self_attn.k_proj.weight),
            ("v", layer.self_attn.v_proj.weight), ("o", layer.self_attn.o_proj.weight),
            ("gate", layer.mlp.gate_proj.weight), ("up", layer.mlp.up_proj.weight),
            ("down", layer.mlp.down_proj.weight))} for layer in m.layers]
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.d, self.eps, self.theta = args.head_dim, args.rms_norm_eps, args.rope_theta
        self.kv = [dict() for _ in self.layers]  # layer -> position -> (k, v), (G, d) each
        self.aux: dict = {}  # position -> hidden state entering layer CUT + 1

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, positions):  # (n, heads, d), halves rotated (traditional=False)
        half = self.d // 2
        angle = positions[:, None] * self.theta ** (-np.arange(half) * 2 / self.d)
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def layer(self, i, h, positions, visible):
        """Layer ``i`` for rows ``h`` at ``positions``: their keys and values stored, each
        row attending to the ``visible`` positions at or before its own. Returns the output
        rows and the rows' queries (n, heads, d)."""
        w, n = self.layers[i], len(positions)
        x = self.rms(h, w["ln1"])
        q = self.rope((x @ w["q"].T).reshape(n, self.heads, self.d), positions)
        k = self.rope((x @ w["k"].T).reshape(n, self.kv_heads, self.d), positions)
        v = (x @ w["v"].T).reshape(n, self.kv_heads, self.d)
        for r, p in enumerate(positions):
            self.kv[i][p] = (k[r], v[r])
        rep = self.heads // self.kv_heads
        out = np.zeros((n, self.heads, self.d))
        for r, p in enumerate(positions):
            keys = [j for j in sorted(visible) if j <= p]
            K = np.stack([self.kv[i][j][0] for j in keys])  # (m, G, d)
            V = np.stack([self.kv[i][j][1] for j in keys])
            for hd in range(self.heads):
                s = K[:, hd // rep] @ q[r, hd] / np.sqrt(self.d)
                a = np.exp(s - s.max())
                out[r, hd] = (a / a.sum()) @ V[:, hd // rep]
        h = h + out.reshape(n, -1) @ w["o"].T
        x = self.rms(h, w["ln2"])
        g = x @ w["gate"].T
        return h + ((g / (1 + np.exp(-g))) * (x @ w["up"].T)) @ w["down"].T, q

    def scores(self, q, positions):
        """The attention of queries ``q`` (heads, d) over the cut layer's keys at
        ``positions``, mean over heads."""
        rep = self.heads // self.kv_heads
        K = np.stack([self.kv[CUT][j][0] for j in positions])
        probs = []
        for hd in range(self.heads):
            s = K[:, hd // rep] @ q[hd] / np.sqrt(self.d)
            a = np.exp(s - s.max())
            probs.append(a / a.sum())
        return np.mean(probs, axis=0)

    def select(self, q, n_ctx, keep):
        """Positions kept after the cut: the newest token's attention over the cut layer's
        keys, mean over heads; the top round(keep * n_ctx), anchor and newest kept."""
        positions = sorted(self.kv[CUT])
        score = self.scores(q, positions)
        score /= np.where([p in self.aux for p in positions], 1 + self.margin, 1)
        forced = {0, n_ctx - 1}
        order = sorted(range(len(positions)),
                       key=lambda r: (positions[r] not in forced, -score[r], positions[r]))
        return sorted(positions[r] for r in order[:max(round(keep * n_ctx), len(forced))])

    def promote(self, n_ctx):
        """Before a decode step: the best-scoring waiting tokens by the newest token's
        queries at the cut, carried through the upper layers as one batch attending over
        every key there, until round(share * n_ctx) tokens have keys above the cut."""
        n = round(self.share * n_ctx) - len(self.kv[CUT + 1])
        if n <= 0:
            return
        positions = sorted(self.kv[CUT])
        score = dict(zip(positions, self.scores(self.last_q, positions)))
        carried = sorted(sorted(self.aux, key=lambda p: (-score[p], p))[:n])
        h = np.stack([self.aux.pop(p) for p in carried])
        for i in range(CUT + 1, len(self.layers)):
            h, _ = self.layer(i, h, np.array(carried), self.kv[i].keys() | set(carried))

    def forward(self, tokens, positions):
        """New tokens at ``positions`` (the newest of the context) through every layer;
        returns the last one's logits and the positions selected at the cut."""
        h, comp = self.embed[tokens], list(positions)
        n_ctx, selected = positions[-1] + 1, []
        held = len(comp) == 1 and n_ctx - self.held_at < self.every
        for i in range(len(self.layers)):
            visible = self.kv[i].keys() | set(comp) if i <= CUT else set(selected) | set(comp)
            h, q = self.layer(i, h, np.array(comp), visible)
            if i == CUT and held:
                selected = self.held + list(range(self.held_at, n_ctx))
            elif i == CUT:
                self.last_q = q[comp.index(n_ctx - 1)]
                # a decode step keeps at least the promoted share
                keep = KEEP if len(positions) > 1 else max(KEEP, self.share)
                selected = self.select(self.last_q, n_ctx, keep)
                self.held, self.held_at = selected, n_ctx
                for r, p in enumerate(comp):
                    if p not in selected:
                        self.aux[p] = h[r]
                stay = [r for r, p in enumerate(comp) if p in selected]
                revived = [p for p in selected if p in self.aux and p not in comp]
                rows = [h[r] for r in stay] + [self.aux.pop(p) for p in revived]
                comp = [comp[r] for r in stay] + revived
                order = np.argsort(comp)
                h, comp = np.stack(rows)[order], [comp[r] for r in order]
        logits = self.rms(h[comp.index(n_ctx - 1)], self.norm) @ self.head.T
        return logits, selected


@pytest.mark.parametrize("revival_block, margin, every, promote",
                         [(64, 0.0, 1, 0), (4, 0.0, 1, 0), (64, 0.3, 1, 0), (64, 0.0, 3, 0),
                          (64, 0.0, 1, 50)])
def test_the_decode_step_is_the_papers(tiny_model, revival_block, margin, every, promote):
    """Prefill and several decode steps: the same selection at the cut, the same tokens
    revived (the upper layers hold keys for exactly the reference's tokens) and the same
    logits. ``revival_block=4`` sends the revived rows through block-causal attention;
    ``margin`` handicaps revivals, and its selections must differ from the paper's; with
    ``every`` 3 the steps between selections select nothing (no selection counted); with
    ``promote`` P (``complete="promote:P"``) the first step carries the best waiting tokens
    on first, once, and the steps keep P%."""
    model, _ = tiny_model("llama")
    prompt = np.random.default_rng(5).integers(0, model.args.vocab_size, PROMPT)
    config = PruningConfig("lazy", prune_layers=(CUT,), keep=(KEEP,), scorer="last",
                           complete=f"promote:{promote}" if promote else "none",
                           revive_margin=margin, reselect_every=every)
    engine = LazyEngine(model, resolve_config(model, config))
    engine.attention.revival_block = revival_block
    chosen = []
    on_host = engine.selector.on_host
    engine.selector.on_host = lambda *a, **k: chosen.append((r := on_host(*a, **k))[0]) or r
    ref, paper = Reference(model, margin, every, promote / 100), Reference(model)

    got = engine.prefill(mx.array(prompt.astype(np.int32)))
    want, selected = ref.forward(prompt, list(range(PROMPT)))
    paper.forward(prompt, list(range(PROMPT)))
    revived, differed = 0, False
    for step in range(STEPS + 1):
        since = list(range(ref.held_at, PROMPT + step))  # generated after the last selection
        assert chosen[-1].tolist() + since == selected, f"step {step}"
        promoted_once = bool(promote and step)  # its choice of tokens scores once too
        assert engine.stats.selections == 1 + step // every + promoted_once, f"step {step}"
        upper = engine.cache.layers[CUT + 1].cached_positions()
        assert sorted(upper.tolist()) == sorted(ref.kv[CUT + 1])
        assert rel_err(got, mx.array(want.astype(np.float32))) < LOGITS_TOL
        if step:
            revived = engine.stats.revivals
        if step == STEPS:
            break
        token = int(np.argmax(want))
        got = engine.decode(token)
        ref.promote(PROMPT + step)
        want, selected = ref.forward(np.array([token]), [PROMPT + step])
        differed |= paper.forward(np.array([token]), [PROMPT + step])[1] != selected
    assert revived > 0  # the steps revived tokens: the revival path was compared
    assert differed == (margin > 0 or every > 1 or promote > 0)
    assert engine.stats.max_computations_per_token_layer == 1
    # the promoted tokens' upper layers, once: the first step brought 50% of the context up
    promoted = round(promote / 100 * PROMPT) - round(KEEP * PROMPT) if promote else 0
    assert engine.stats.completed_token_layers == promoted * (len(ref.layers) - CUT - 1)
