"""GGUF ``gemma4`` -> MLX ``gemma4_text``: tiny random Gemma 4 GGUFs written as llama.cpp's
converter writes them (its Gemma4Model, ported: sliding layers by a flag each, head sizes and
key/value heads by layer kind, the global layers' partial RoPE as a ``rope_freqs`` tensor, the
experts' fused gate/up stacks and per-expert scales, E2B/E4B's shared keys, double-wide MLPs
and per-layer inputs, a "gemma4" BPE vocabulary with merges), converted and compared with
mlx-lm's own gemma4_text on the dequantized tensors, and through the engine; their bad
inputs."""

from __future__ import annotations

import mlx_lazy  # noqa: F401  (OpenBLAS before mlx)

import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from mlx_lazy import PruningConfig
from mlx_lazy.api import prompt_token_ids
from mlx_lazy.convert import convert
from numerics import rel_err
from test_convert import assert_refused, encode
from test_engine import LOGITS_TOL, mlx_lm_error
from test_gguf_tokenizer import llama_cpp_gemma4
from tiny_models import VOCAB_SIZE, tiny_config

# mlx-lm's parameter (suffix) -> llama.cpp's tensor, as gguf's tensor map has Gemma 4's
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
       "model.embed_tokens_per_layer": "per_layer_token_embd",
       "model.per_layer_model_projection": "per_layer_model_proj",
       "model.per_layer_projection_norm": "per_layer_proj_norm"}
LAYER = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "post_attention_norm.weight",
         "pre_feedforward_layernorm.weight": "ffn_norm.weight",
         "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
         "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
         "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
         "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight",
         "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
         "router.per_expert_scale": "ffn_down_exps.scale",
         "experts.switch_glu.gate_proj.weight": "ffn_gate_exps.weight",
         "experts.switch_glu.up_proj.weight": "ffn_up_exps.weight",
         "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight",
         "layer_scalar": "layer_output_scale.weight",
         "per_layer_input_gate.weight": "inp_gate.weight",
         "per_layer_projection.weight": "proj.weight",
         "post_per_layer_input_norm.weight": "post_norm.weight"}

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
USER = ["<|tool_call>", "<tool_call|>", "<|tool_response>", "<|channel>", "<channel|>"]
CORPUS = ("The passkey is 12345. Remember it.\nThe quick brown fox jumps over the lazy dog.\n\n"
          "What is the passkey?  Two spaces, then three   and a tab\tend.\n") * 3
TEXT = "The passkey is 12345.  Remember it!\n\nÜnïcödé 😀 <|tool_call>x<tool_call|> end"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def gemma4_vocabulary() -> dict:
    """A tiny "gemma4" vocabulary as llama.cpp's converter writes one: control and
    user-defined tokens, the 256 byte tokens, a BPE (with its merges) trained here on text
    whose spaces are "\u2581", padded with unused tokens to the tiny models' vocabulary."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    bpe.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL) - len(USER) - 256, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens = SPECIAL + USER + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [3] * len(SPECIAL) + [4] * len(USER) + [6] * 256 + [1] * len(learned)
    pad = VOCAB_SIZE - len(tokens)
    assert pad >= 0
    return {"tokens": tokens + [f"<unused{i}>" for i in range(pad)], "types": types + [1] * pad,
            "merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]}


def add_vocabulary(w: gguf.GGUFWriter, add_bos: bool | None = True, merges: bool = True) -> dict:
    """The vocabulary's metadata (``add_bos`` None: no flag); returns the tokenizer's keys."""
    v = gemma4_vocabulary()
    w.add_tokenizer_model("gemma4")
    w.add_token_list(v["tokens"])
    w.add_token_scores([0.0] * len(v["tokens"]))
    w.add_token_types(v["types"])
    if merges:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    return {"tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.token_type": v["types"],
            "tokenizer.ggml.merges": v["merges"], "tokenizer.ggml.bos_token_id": 2}


def gguf_name(name: str) -> str:
    for base, gname in TOP.items():
        if name.startswith(base + "."):
            return gname + name[len(base):]
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}"


def write_gemma4_gguf(path: Path, kind: str = "gemma4_text", types: dict | None = None,
                      meta: dict | None = None, drop: tuple = (), extra: dict | None = None,
                      fused: bool = True, add_bos: bool | None = True, merges: bool = True,
                      **overrides) -> tuple[dict, dict]:
    """A random tiny ``kind`` (a gemma4_text variant) as llama.cpp's Gemma4Model writes it:
    per layer kind its head size (``key_length``: the global layers', ``key_length_swa``) and
    key/value heads (an array where the config has global ones), a flag per layer for the
    sliding ones, RoPE bases by kind and ``rope_freqs`` (1 for the rotated frequencies of a
    global head, 1e30 for the rest), MLP widths per layer where E2B's double; the experts'
    gate and up stacks in one tensor (``fused``) or two, the router's scale and per-expert
    scales (``ffn_down_exps.scale``), the layer scalars.

    ``types`` maps a tensor role ("attn_q", "ffn_gate_up_exps", "*" for other matrices) to its
    type; ``meta`` overrides metadata (None leaves a key out); ``drop`` leaves tensors out;
    ``extra`` adds float32 tensors; ``add_bos`` is the flag written (None: none), ``merges``
    whether the merges are. Returns (config, reference weights: what the stored
    tensors dequantize to, in mlx-lm's names)."""
    types, meta = types or {}, meta or {}
    config = {**tiny_config(kind), **overrides}
    args = gemma4_text.ModelArgs.from_dict(config)
    rope = args.rope_parameters
    flags = [t == "sliding_attention" for t in args.layer_types]
    n, first_shared = args.num_hidden_layers, args.num_hidden_layers - args.num_kv_shared_layers
    ff = ([args.intermediate_size if i < first_shared else 2 * args.intermediate_size
           for i in range(n)] if args.use_double_wide_mlp else args.intermediate_size)
    kv = ([args.num_key_value_heads if x else args.num_global_key_value_heads for x in flags]
          if args.num_global_key_value_heads is not None else args.num_key_value_heads)
    full_rot = int(args.global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    values = {
        "block_count": n, "context_length": args.max_position_embeddings,
        "embedding_length": args.hidden_size, "feed_forward_length": ff,
        "head_count": args.num_attention_heads, "head_count_kv": kv,
        "rope_freq_base": rope["full_attention"]["rope_theta"],
        "rope_freq_base_swa": rope["sliding_attention"]["rope_theta"],
        "layer_norm_rms_eps": args.rms_norm_eps,
        "key_length": args.global_head_dim, "value_length": args.global_head_dim,
        "key_length_swa": args.head_dim, "value_length_swa": args.head_dim,
        "final_logit_softcapping": args.final_logit_softcapping,
        "sliding_window": args.sliding_window, "shared_kv_layers": args.num_kv_shared_layers,
        "embedding_length_per_layer_input": args.hidden_size_per_layer_input,
        "sliding_window_pattern": flags,
        "rope_dimension_count": args.global_head_dim, "rope_dimension_count_swa": args.head_dim,
        **({"expert_count": args.num_experts, "expert_used_count": args.top_k_experts,
            "expert_feed_forward_length": args.moe_intermediate_size}
           if args.enable_moe_block else {}),
        **meta}
    w = gguf.GGUFWriter(str(path), "gemma4")
    for key, value in values.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    vocab = add_vocabulary(w, add_bos, merges)
    rng = np.random.default_rng(0)
    model = gemma4_text.Model(args)
    reference, stored = {}, {}
    for name, p in tree_flatten(model.parameters()):
        gname = gguf_name(name)
        role = gname.split(".")[-2]
        if p.ndim >= 2:
            x, qtype = rng.normal(0, 0.05, p.shape), types.get(role, types.get("*", T.F32))
        else:  # norms, the router's scales, the layer scalars: around one (stored as w)
            x, qtype = 1.0 + 0.1 * rng.normal(size=p.shape), T.F32
        stored[gname] = (x.astype(np.float32), qtype, name)
    if fused and args.enable_moe_block:  # HF's experts.gate_up_proj: gate rows, then up rows
        for i in range(n):
            gate = stored.pop(f"blk.{i}.ffn_gate_exps.weight")
            up = stored.pop(f"blk.{i}.ffn_up_exps.weight")
            stored[f"blk.{i}.ffn_gate_up_exps.weight"] = (
                np.concatenate([gate[0], up[0]], axis=1),
                types.get("ffn_gate_up_exps", types.get("*", T.F32)), (gate[2], up[2]))
    if "rope_freqs.weight" not in drop and not all(flags):
        stored["rope_freqs.weight"] = (np.array([1.0] * full_rot + [1e30] * (
            args.global_head_dim // 2 - full_rot), np.float32), T.F32, None)
    for gname, (x, qtype, name) in stored.items():
        if gname in drop:
            continue
        data = encode(x, qtype, rng)
        back = gguf.dequantize(data, qtype).reshape(x.shape)
        if isinstance(name, tuple):  # the fused stack: the reference's two halves
            for part, half in zip(name, np.split(back, 2, axis=1)):
                reference[part] = mx.array(half)
        elif name is not None:
            reference[name] = mx.array(back)
        w.add_tensor(gname, data, raw_dtype=qtype)
    for gname, x in (extra or {}).items():
        w.add_tensor(gname, np.asarray(x, np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config["_vocabulary"] = vocab
    return config, reference


def reference_model(config: dict, weights: dict) -> gemma4_text.Model:
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(
        {k: v for k, v in config.items() if not k.startswith("_")}))
    model.load_weights(list(weights.items()))
    return model


# E2B's tiny layout: its global layers have the sliding ones' key/value heads (the real E2B's
# config has no global count; the tiny variant's 1 is mlx-lm's, unused without K = V)
E2B = {"num_global_key_value_heads": None}
CASES = {
    # the 31B's layout: values from the keys' projection in the global layers, 1 key/value
    # head there and 2 in the sliding ones, heads 32 and 16 wide, RoPE over a quarter of a
    # global head
    "dense-f32": ("gemma4_text", {}, {}),
    "dense-legacy": ("gemma4_text", {"token_embd": T.BF16, "attn_q": T.Q4_0, "attn_k": T.Q4_1,
                                     "ffn_down": T.F16, "*": T.Q8_0}, {}),
    # 26B A4B: the experts beside each dense MLP, their gate/up stack fused
    "moe-fused": ("gemma4_text-moe", {"ffn_gate_up_exps": T.Q8_0, "ffn_down_exps": T.Q4_0,
                                      "ffn_gate_inp": T.F32, "*": T.BF16}, {}),
    "moe-split": ("gemma4_text-moe", {"ffn_gate_exps": T.Q4_1, "ffn_up_exps": T.Q8_0, "*": T.F16},
                  {"_fused": False}),
    # E2B/E4B: layers 2 and 3 read the keys of 0 and 1, MLPs twice as wide there, per-layer
    # inputs (their embedding kept quantized)
    "e2b": ("gemma4_text-e2b", {"token_embd": T.F16, "per_layer_token_embd": T.Q8_0,
                                "attn_q": T.Q4_0, "*": T.Q8_0},
            E2B),
}


@pytest.mark.parametrize("dtype", ["float32", None])
@pytest.mark.parametrize("case", CASES)
def test_gemma4_gguf_matches_its_dequantized_tensors(case, dtype, tmp_path):
    """The converted folder computes what mlx-lm's gemma4_text computes with the GGUF's
    tensors, past the sliding window; its tokenizer gives llama.cpp's ids (BOS first) and the
    text back; its end-of-generation ids are llama.cpp's."""
    kind, types, overrides = CASES[case]
    overrides = dict(overrides)
    fused = overrides.pop("_fused", True)
    config, reference = write_gemma4_gguf(tmp_path / "g.gguf", kind, types, fused=fused,
                                          **overrides)
    out = convert(tmp_path / "g.gguf", tmp_path / "out", dtype=dtype)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "gemma4_text"
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (saved["head_dim"], saved["global_head_dim"], saved["sliding_window"]) == (16, 32, 24)
    assert saved["rope_parameters"] == {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 1.0,
                              "rope_theta": 1e4}}
    model, tok = mlx_lm.load(str(out))
    ref = reference_model(config, reference)
    ids = tok.encode(TEXT)
    assert ids == llama_cpp_gemma4(config["_vocabulary"], TEXT)
    assert tok.decode(ids[1:]) == TEXT and ids.count(2) == 1
    assert tok.eos_token_ids == {1, 6, 9}  # <eos>, <turn|>, <|tool_response>
    x = mx.array(ids * 3)[None]
    assert x.shape[1] > 24
    tol = 1e-5 if dtype else 4e-3  # kept quantized: float16 scales, as test_convert's
    assert rel_err(model(x), ref(x)) < tol


@pytest.mark.parametrize("case", ["dense-f32", "moe-fused", "e2b"])
def test_the_engine_runs_a_converted_gemma4_as_mlx_lm_does(case, tmp_path):
    kind, types, overrides = CASES[case]
    write_gemma4_gguf(tmp_path / "g.gguf", kind, types, **overrides)
    model, tok = mlx_lm.load(str(convert(tmp_path / "g.gguf", tmp_path / "out",
                                         dtype="float32")))
    prompt = mx.array(tok.encode(TEXT * 6))
    assert mlx_lm_error(model, PruningConfig("full"), prompt, 16, block_size=32) < LOGITS_TOL


def test_the_chat_path_adds_one_bos(tmp_path):
    """llama.cpp adds BOS to a Gemma 4 prompt whatever the GGUF says; the chat template writes
    it too: mlx-lm's and the engine's prompt encoding add it only where the text lacks it."""
    for said in (None, False):
        write_gemma4_gguf(tmp_path / f"{said}.gguf", add_bos=said)
        _, tok = mlx_lm.load(str(convert(tmp_path / f"{said}.gguf", tmp_path / f"{said}")))
        chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
        assert chat.startswith("<bos><|turn>user")
        for text in (chat, "Hi"):
            ids = prompt_token_ids(tok, text)
            assert ids[0] == 2 and ids.count(2) == 1


def test_missing_tensors_are_llama_cpps_defaults_and_shared_layers_keys_unused(tmp_path):
    """Without layer scalars and per-expert scales (llama.cpp then scales by nothing) the model
    is mlx-lm's with ones there; the key/value projections an E2B GGUF may hold for the layers
    that share keys are dropped (neither llama.cpp nor mlx-lm reads them); a GGUF without a
    soft-cap gets llama.cpp's 30."""
    drop = tuple(f"blk.{i}.{t}" for i in range(4)
                 for t in ("layer_output_scale.weight", "ffn_down_exps.scale"))
    config, reference = write_gemma4_gguf(tmp_path / "g.gguf", "gemma4_text-moe", drop=drop,
                                          meta={"final_logit_softcapping": None})
    for i in range(4):
        reference[f"model.layers.{i}.layer_scalar"] = mx.ones((1,))
        reference[f"model.layers.{i}.router.per_expert_scale"] = mx.ones((4,))
    model, _ = mlx_lm.load(str(convert(tmp_path / "g.gguf", tmp_path / "out",
                                       dtype="float32")))
    assert model.args.final_logit_softcapping == 30.0
    x = mx.array([[2, 40, 50, 60, 70, 80]])
    assert rel_err(model(x), reference_model(config, reference)(x)) < 1e-5

    shared = {f"blk.{i}.{t}.weight": np.zeros(shape, np.float32) for i in (2, 3)
              for t, shape in (("attn_k", (32, 64)), ("attn_v", (32, 64)), ("attn_k_norm", (16,)))}
    config, reference = write_gemma4_gguf(tmp_path / "e.gguf", "gemma4_text-e2b", extra=shared,
                                          **E2B)
    model, _ = mlx_lm.load(str(convert(tmp_path / "e.gguf", tmp_path / "e", dtype="float32")))
    assert model.args.num_kv_shared_layers == 2 and model.args.use_double_wide_mlp
    assert rel_err(model(x), reference_model(config, reference)(x)) < 1e-5


def test_q_bits_requantizes_a_gemma4_moe(tmp_path):
    """--q-bits through mlx-lm's choice (the router at 8 bits, as its quant_predicate says):
    the same weights as mlx-lm's convert of the float16 conversion."""
    from test_convert import saved_weights

    write_gemma4_gguf(tmp_path / "g.gguf", "gemma4_text-moe", {"*": T.Q8_0})
    float16 = convert(tmp_path / "g.gguf", tmp_path / "f16", dtype="float16")
    want = saved_weights(convert(float16, tmp_path / "via-mlx-lm", q_bits=4, q_group_size=32))
    have = saved_weights(convert(tmp_path / "g.gguf", tmp_path / "q", q_bits=4,
                                 q_group_size=32))
    assert sorted(have) == sorted(want)
    assert "model.layers.0.experts.switch_glu.gate_proj.scales" in have
    for name, x in want.items():
        assert have[name].dtype == x.dtype and mx.array_equal(have[name], x), name


def bad_gguf(case: str, path: Path) -> str:
    """Write the bad GGUF of ``case``; return the error's expected fragment."""
    if case == "period":  # llama.cpp reads a flag per layer only
        write_gemma4_gguf(path, meta={"sliding_window_pattern": 2})
        return "sliding_window_pattern must be a flag per layer"
    if case == "no-rope-freqs":
        write_gemma4_gguf(path, drop=("rope_freqs.weight",))
        return "lacks rope_freqs.weight"
    if case == "rope-freqs":  # Llama 3's kind of divisors, not Gemma 4's
        write_gemma4_gguf(path, drop=("rope_freqs.weight",),
                          extra={"rope_freqs.weight": np.linspace(1, 8, 16)})
        return "rope_freqs are not Gemma 4's proportional RoPE"
    if case == "partial-sliding":
        write_gemma4_gguf(path, meta={"rope_dimension_count_swa": 8})
        return "RoPE over 8 of its sliding layers' 16 head dims"
    if case == "kv-heads":  # llama.cpp's converter writes the tiny E2B's unused global count
        write_gemma4_gguf(path, "gemma4_text-e2b")
        return "1 key/value heads in its global layers and 2 in its sliding ones"
    if case == "shared-source":  # layer 2 (sliding) would read layer 0 (global) in llama.cpp
        write_gemma4_gguf(path, "gemma4_text-e2b",
                          meta={"sliding_window_pattern": [False, True, True, False]}, **E2B)
        return "layer 2 reads the keys of layer 0"
    if case == "widths":
        write_gemma4_gguf(path, meta={"feed_forward_length": [128, 128, 256, 128]})
        return "MLP widths by layer other than E2B/E4B's"
    if case == "some-experts":
        drop = ("blk.1.ffn_gate_inp.weight",)
        write_gemma4_gguf(path, "gemma4_text-moe", drop=drop)
        return "experts in 3 of its 4 layers"
    if case == "missing":
        write_gemma4_gguf(path, drop=("blk.2.post_ffw_norm.weight",))
        return "lacks model.layers.2.post_feedforward_layernorm.weight"
    if case == "merges":
        write_gemma4_gguf(path, merges=False)
        return "lacks tokenizer.ggml.merges"
    raise AssertionError(case)


BAD = ["period", "no-rope-freqs", "rope-freqs", "partial-sliding", "kv-heads", "shared-source",
       "widths", "some-experts", "missing", "merges"]


@pytest.mark.parametrize("case", BAD)
def test_bad_gemma4_gguf_is_one_error_and_nothing_written(case, tmp_path, capsys):
    src = tmp_path / "bad.gguf"
    fragment = bad_gguf(case, src)
    assert_refused(src, tmp_path, capsys, fragment)
