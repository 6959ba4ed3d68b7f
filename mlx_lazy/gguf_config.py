"""mlx-lm's ``config.json`` of a GGUF model, read from its metadata (for
:mod:`mlx_lazy.conversion`; its tensors become mlx-lm's arrays in :mod:`mlx_lazy.gguf_tensors`,
its vocabulary a tokenizer in :mod:`mlx_lazy.gguf_tokenizer`).

The converted model is mlx-lm's model of the checkpoint. Where llama.cpp computes otherwise
and another of mlx-lm's models computes what llama.cpp does, the GGUF becomes that one
(``deepseek2`` with another latent epsilon: ``glm4_moe_lite``); where none does, a difference
is refused in one line, but for the epsilon of norms that mlx-lm's port fixes apart from the
config's, where llama.cpp takes the GGUF's one epsilon (the latent norms of DeepSeek's MLA and
Kimi Delta Attention's q/k L2 norms, whose fixed 1e-6 is the original model's too; PLaMo 2's
and Llama 4's q/k norms): those keep mlx-lm's, the difference measured in docs/conversion.md.

The architectures (llama.cpp's names), and what converting each involves:

* ``llama``: Llama 2/3.x, Mistral's GGUFs too; Llama 3.1/3.2's ``rope_freqs`` become
  mlx-lm's ``llama3`` RoPE scaling. ``qwen2``, ``qwen3``; ``qwen3moe`` (mlx-lm's
  ``qwen3_moe``): the experts' stacked weights.
* ``qwen2vl``, ``qwen3vl``, ``qwen3vlmoe`` (:data:`QWEN_VL`: the text model of Qwen2-VL /
  Qwen2.5-VL, Qwen3-VL, Qwen3-VL MoE; the vision tower is llama.cpp's separate mmproj file):
  mlx-lm's plain ``qwen2``, ``qwen3``, ``qwen3_moe``. Their M-RoPE turns every section by the
  same position on text (NeoX RoPE, the sections unread but required, as llama.cpp requires
  them); Qwen3-VL's deepstack layers add embedding slices that are zero for text tokens.
* Sparse MoE (:func:`_sparse_moe_config`): a ``llama`` GGUF with experts is Mixtral
  (``mixtral``: its experts at ``block_sparse_moe``); ``qwen2moe`` (Qwen1.5/2-MoE,
  ``qwen2_moe``): a sigmoid-gated shared expert; ``olmoe``: q/k norms over all heads, the top
  experts' weights not renormalised; ``granitemoe``: Granite's multipliers (not Granite MoE
  Shared's shared expert).
* ``gemma3`` (``gemma3_text``): llama.cpp stores Gemma's norm weights as 1 + w, mlx-lm as w;
  its SentencePiece vocabulary becomes a byte-fallback BPE.
* ``gemma2`` (Gemma 2 2B/9B/27B): Gemma 3's norms and vocabulary; its attention and final
  logit soft-caps, and the query scale llama.cpp's graph implies. mlx-lm's ``gemma2`` has no
  sliding window (llama.cpp's every other layer does, 4096 tokens): the converted model
  computes what llama.cpp computes for contexts up to the window, not beyond.
* ``gemma4`` (``gemma4_text``; Gemma 4 31B, 26B A4B, E2B/E4B): sliding layers by a flag
  each, head sizes and key/value heads by kind of layer, values from the keys where a global
  layer has no ``attn_v``, the global layers' partial RoPE from ``rope_freqs`` as mlx-lm's
  proportional RoPE, the experts' fused gate/up stacks split, shared keys, double-wide MLPs
  and per-layer inputs; its "gemma4" BPE vocabulary.
* ``gemma3n`` (Gemma 3n E2B/E4B's text model; mlx-lm's ``gemma3n``, its ``text_config``): its
  norms as stored (w), AltUp's stacked projections split per stream, LAuReL, per-layer inputs
  (every row of their embedding read by token id, as llama.cpp does), what llama.cpp's graph
  hard-wires as settings (AltUp's 4 streams with the first active, sparse MLP gates in the
  first 10 layers, keys and values shared from the 20th layer on, a logit soft-cap of 30, no
  clip of AltUp's coefficients); a GGUF whose metadata says otherwise is refused; Gemma's
  SentencePiece vocabulary.
* ``phi3`` (Phi-3/3.5, Phi-4-mini): fused q/k/v and gate/up tensors as mlx-lm's ``phi3``
  has them, partial RoPE, LongRoPE factors.
* ``gpt-oss`` (``gpt_oss``): attention sinks, biases, the sliding-window layers, YaRN RoPE;
  not llama.cpp's optional fused ``ffn_gate_up_exps``.
* ``smollm3``: no RoPE in every 4th layer, as llama.cpp hard-wires it. ``granite`` (3.x
  dense): its embedding, residual, attention and logit multipliers. ``olmo2``: norms after
  each branch (an OLMo 3 GGUF, with a sliding window, is refused). ``exaone4``: its sliding
  window and pattern, global layers without RoPE, Llama 3 RoPE scaling from ``rope_freqs``.
* ``qwen35`` / ``qwen35moe`` (Qwen3.5/3.6's text model, ``qwen3_5`` / ``qwen3_5_moe``):
  llama.cpp's changes to the Gated DeltaNet layers undone (A_log from its −exp(A_log), the
  conv unsqueezed, the value heads it tiles grouped again); the full-attention period from
  its flags or interval; partial RoPE, as its MRoPE is on text; a shared expert; the
  multi-token prediction block dropped.
* ``qwen3next`` (``qwen3_next``): Qwen3.5's layers before llama.cpp tiled them, its q/k/v/z
  projection fused again from ``attn_qkv`` and ``attn_gate``; every layer sparse.
* ``glm4moe`` (``glm4_moe``; GLM-4.5/4.6/4.7): leading dense layers, then sigmoid-routed
  experts with their correction bias, expert groups and scale beside shared experts; q/k/v
  biases, q/k norms, partial RoPE; the NextN block dropped.
* ``seed_oss``: biases where the GGUF has them, the norm before the MLP under llama.cpp's
  ``post_attention_norm``.
* ``ernie4_5`` / ``ernie4_5-moe`` (``ernie4_5`` / ``ernie4_5_moe``): q/k as they are, both
  models' RoPE being the traditional one; the MoE's experts' stacks, shared experts, leading
  dense layers and interval; a router correction bias that would change which experts are
  picked is refused.
* ``mistral3`` (``ministral3``; Ministral 3): q/k un-permuted, YaRN RoPE with llama.cpp's
  defaults, Llama 4's attention temperature.
* ``deepseek2`` (multi-head latent attention: DeepSeek-V2/V2-Lite to ``deepseek_v2``;
  DeepSeek-V3/R1, Kimi and Moonlight, sigmoid-routed with a correction bias, to
  ``deepseek_v3``; GLM-4.7-Flash to ``glm4_moe_lite``): the latent ranks and head widths
  from llama.cpp's MLA keys, ``attn_k_b`` / ``attn_v_b`` (or an older file's ``attn_kv_b``)
  as each model holds its up-projection; leading dense layers, experts and shared experts,
  expert groups, YaRN with its log multiplier as ``mscale_all_dim``; traditional RoPE, q/k as
  they are. The NextN block dropped. Without experts (Youtu-LLM) to ``youtu_llm``.
* ``mistral4`` (Mistral Small 4, llama.cpp's deepseek2 graph, ``mistral4``): deepseek2's latent
  attention and experts, softmax-routed (the chosen weights renormalised where
  ``expert_weights_norm``, expert groups ranked by their two best experts, as in both), YaRN;
  Llama 4's attention temperature where the GGUF gives one (llama.cpp's converter writes none:
  then none), the latent norms' epsilon 1e-6 (mlx-lm's, hard-wired; llama.cpp's the GGUF's).
* ``deepseek32`` (DeepSeek-V3.2, ``deepseek_v32``) and ``glm-dsa`` (GLM-5, ``glm_moe_dsa``):
  deepseek2's latent attention and sigmoid-routed experts (YaRN as deepseek2's) with each
  layer's lightning indexer (``indexer.attn_q_b``, ``attn_k``, ``k_norm``, ``proj``; its heads,
  width and top-k from ``attention.indexer.*``), its RoPE NeoX-style in DeepSeek-V3.2 and
  traditional in GLM-5, as llama.cpp turns them; the latent norms' epsilon 1e-6 (mlx-lm's and
  the original models', whatever the GGUF's: GLM-5's is 1e-5, which llama.cpp takes there);
  GLM-5.2's layers that reuse another's indexer refused. (mlx-lm's indexer key norm takes an
  epsilon of 1e-5, llama.cpp's 1e-6: it can only move a near-tie at the top-k's edge.)
* ``glm4`` (GLM-4-0414 9B/32B): norms after each branch, the MLP's gate then up rows in one
  tensor (mlx-lm's ``gate_up_proj``), q/k/v biases, traditional RoPE over part of each head
  (NeoX where the GGUF has MRoPE sections: GLM-4.1V's, GLM-OCR's text model, whose q/k rows
  llama.cpp's converter reordered); the embedding as the head where the GGUF has none; the
  NextN block dropped.
* ``starcoder2``: LayerNorms and biases everywhere, a GELU MLP; no sliding window in llama.cpp
  nor mlx-lm. (mlx-lm's GELU is the exact one, llama.cpp's the tanh approximation: ~1e-4 of
  the logits.)
* ``cohere2`` (Command R7B): attention and the MLP in parallel on one LayerNorm (no biases),
  the window in llama.cpp's pattern (every p-th layer global, without RoPE), the logit scale.
* ``gemma`` (Gemma 1 2B/7B, CodeGemma): Gemma 3's norms (stored as 1 + w) and vocabulary, heads
  ``attention.key_length`` wide, NeoX RoPE, the embedding as the head. (mlx-lm's GELU is the
  exact one, llama.cpp's the tanh approximation: ~5e-5 of the logits.)
* ``command-r`` (``cohere``; Command R, R+, Aya 23): cohere2's parallel layers on one LayerNorm
  (no biases) in every layer globally, traditional RoPE, the logit scale (none: unscaled, as
  llama.cpp's), per-head q/k LayerNorms (Command R+) where the GGUF has them.
* ``exaone`` (EXAONE 3.0/3.5): Llama's layers under GPT-2's names (mlx-lm's ``exaone``), Llama
  3's RoPE scaling from ``rope_freqs``; no biases.
* ``apertus``: q/k norms, its xIELU's parameters from llama.cpp's metadata, Llama 3's RoPE
  scaling from ``rope_freqs``; no biases (llama.cpp's loader reads none).
* ``hunyuan-dense`` (Hunyuan 0.5B-7B dense, ``hunyuan_v1_dense``): q/k norms after RoPE, its
  NTK-alpha RoPE as the base llama.cpp's converter folds alpha into (or ``rope.scaling.alpha``
  folded in as llama.cpp's loader does); no biases (llama.cpp reads no output one).
* ``stablelm`` (StableLM 2 1.6B/12B, StableLM 3B): LayerNorms with biases, partial NeoX RoPE,
  q/k/v biases, the 12B's per-head q/k LayerNorms (llama.cpp's stacks split) and parallel
  residual, each where the tensors have them (as llama.cpp decides).
* ``phi2`` (Phi-1.5, Phi-2; mlx-lm's ``phi``): attention and a GELU MLP in parallel on one
  LayerNorm, biases everywhere (the head's too), partial NeoX RoPE; a fused ``attn_qkv`` (older
  conversions) cut into q, k and v.
* ``gptneox`` (Pythia, GPT-NeoX; ``gpt_neox``): ``attn_qkv`` (q, k, v rows, as llama.cpp's
  converter reorders them) put back in each head's q, k, v order, partial NeoX RoPE,
  LayerNorms with biases, the parallel residual or not (``use_parallel_residual``); grouped
  key/value heads and an MLP other than 4 x hidden refused (mlx-lm's model has neither).
* ``minicpm`` (MiniCPM 1B/2B): q/k un-permuted, its embedding, residual and logit scales
  (llama.cpp's defaults where the GGUF has none), the logits scaled through a head of its own
  where the GGUF ties it.
* ``minicpm3`` (MiniCPM3-4B): deepseek2's latent attention with low-rank queries and its
  ``attn_kv_b`` as mlx-lm's ``kv_b_proj``, values hidden / heads wide; the embedding, residual
  and logit scales llama.cpp hard-wires (12, 1.4 / sqrt(layers), 256 / hidden), the logits
  scaled through a head of its own where the GGUF ties it; NeoX RoPE (q/k as they are) by the
  short LongRoPE factors, the ones llama.cpp turns by within the model's context.
* ``dots1`` (dots.llm1): DeepSeek's MoE layout (GLM-4.5's reading: leading dense layers,
  sigmoid-routed experts with their selection bias, zeros where the GGUF has none, as llama.cpp
  then adds none; expert groups, shared experts, the weights' renormalisation and scale) beside
  q/k norms before NeoX RoPE.
* ``llama4`` (Llama 4 Scout/Maverick's text model; mlx-lm's ``llama4``, its ``text_config``):
  chunked attention and RoPE in 3 of every 4 layers, llama.cpp's chunk and attention temperature
  in the others, weightless q/k norms (not Maverick's); one sigmoid-weighed expert a token beside
  a shared expert every ``interleave_moe_layer_step``-th layer; Llama 3's RoPE scaling from
  ``rope_freqs``. (mlx-lm's q/k norms take an epsilon of 1e-6, llama.cpp's the GGUF's.)
* ``lfm2`` (LFM2 350M-2.6B) / ``lfm2moe`` (LFM2-8B-A1B, ``lfm2_moe``): short gated
  convolutions in the layers llama.cpp gives no key/value heads (``attention.head_count_kv`` per
  layer), attention with q/k norms in the others; the kernels from llama.cpp's (channels, width)
  to MLX's Conv1d layout; ``token_embd_norm`` as the final norm (mlx-lm's ``embedding_norm``);
  the MLP width as written (already auto-adjusted); a tied head only; LFM2-8B-A1B's leading
  dense layers, sigmoid-routed experts with their selection bias, top weights renormalised.
* ``internlm2`` (InternLM2/2.5): q/k un-permuted and fused again with v into mlx-lm's ``wqkv``
  (each key/value head's queries, key and value), llama.cpp's linear RoPE scaling (its
  converter writes none for InternLM2.5's dynamic NTK: plain RoPE, as llama.cpp runs it); no
  biases (llama.cpp reads no output one).
* ``qwen`` (Qwen 1): fused q/k/v with its bias as mlx-lm's ``c_attn`` (NeoX RoPE, as they
  are), the MLP's gate ``w2`` and up ``w1``; mlx-lm's hard-wired RoPE base and no
  grouped-query attention, so other GGUFs are refused.
* ``gpt2`` (GPT-2) / ``starcoder`` (StarCoder 1, SantaCoder; mlx-lm's ``gpt_bigcode``):
  learned positions (``position_embd``, as many as the context), fused q/k/v (``attn_qkv`` as
  mlx-lm's ``c_attn``), LayerNorms and biases everywhere, a GELU MLP. GPT-2: as many key/value
  heads as query heads, the MLP 4 x hidden and the head the embedding (mlx-lm's gpt2 hard-wires
  all three: anything else refused); StarCoder: one key/value head (multi-query) or as many as
  the queries, a head of its own where the GGUF has one. (mlx-lm's gpt_bigcode GELU is the exact
  one, llama.cpp's the tanh approximation.)
* ``nemotron`` (Nemotron-3, Minitron): LayerNorms with biases whose weights llama.cpp stores as
  1 + w (mlx-lm's ``nemotron`` adds the 1 itself), partial NeoX RoPE with its linear scaling, a
  squared-ReLU MLP; q/k/v/o and MLP biases where the tensors have them.
* ``openelm`` (OpenELM): query and key/value heads and MLP widths per layer (llama.cpp's
  arrays), the fused q/k/v as it is, the MLP's gate and up halves (which llama.cpp's converter
  cut apart) fused again; per-head q/k norms, a tied head.
* ``deepseek`` (DeepSeek-MoE 16B, DeepSeek LLM 1): q/k un-permuted, leading dense layers, then
  softmax-routed experts (not renormalised; a weights scale other than 1 refused) beside shared
  experts; the embedding as the head where the GGUF has none; no biases.
* ``mellum`` (JetBrains Mellum): q/k norms before NeoX RoPE, the window in llama.cpp's pattern
  (flags, or a period: 4 unless given), renormalised softmax-routed experts in every layer;
  one RoPE base (llama.cpp's graph turns the sliding layers at the global one: a GGUF whose
  ``rope.freq_base_swa`` differs is refused).
* ``exaone-moe`` (K-EXAONE, ``exaone_moe``): per-head q/k norms, RoPE in the sliding-window
  layers only (llama.cpp's pattern: flags, or a period, 4 unless given; a GGUF without a local
  layer refused: mlx-lm's exaone_moe then turns every layer), one RoPE base; DeepSeek's MoE
  reading (dots1's: leading dense layers, sigmoid-routed experts with their selection bias,
  expert groups, shared experts, renormalisation and scale); the NextN blocks dropped.
* ``afmoe`` (Arcee AFM, Trinity): embeddings times sqrt(hidden) and each head's output gate
  (``attn_gate``), norms before and after each branch, q/k norms; RoPE (one base) in every layer
  but each 4th, as llama.cpp hard-wires it, which mlx-lm's afmoe turns in its sliding layers
  only: a GGUF whose window pattern differs (or without a window) is refused; dots1's MoE
  reading, sigmoid routing (llama.cpp's default), a tied head where the GGUF has none.
* ``minimax-m2`` (MiniMax-M2/M2.1, ``minimax``): q/k norms over all heads, NeoX RoPE over
  ``rope.dimension_count`` of each head, sigmoid-routed experts (llama.cpp's gating function
  required) with their selection bias, renormalised, in every layer.
* ``minimax-m3`` (MiniMax-M3's text model, ``minimax_m3_vl``'s ``text_config``): the norms as
  stored (1 + w: plain RMS norms), per-head q/k norms, NeoX RoPE over ``rope.dimension_count``,
  SwiGLU-OAI; DeepSeek's MoE reading after the leading dense layers (sigmoid routing with a
  selection bias, renormalised, in one group: else refused, scaled) beside a shared expert; the
  indexer (``attention.indexer.*``) in those MoE layers, llama.cpp's sparse ones.
* ``mimo2`` (MiMo-V2-Flash, ``mimo_v2_flash``): sliding-window layers by a flag each, with their
  own key/value heads, sinks and RoPE base (one setting for each kind of layer, as mlx-lm's
  model takes), values narrower than keys and scaled, partial NeoX RoPE; sigmoid-routed experts
  (a selection bias, renormalised) where a layer has a router; the NextN blocks dropped.
* ``step35`` (Step-3.5, ``step3p5``): sliding-window layers by a flag each, with their own
  heads, key/value heads, RoPE base and rotated dims (the global layers half of them, as
  llama.cpp hard-wires it), per-head q/k norms (stored as 1 + w, as mlx-lm holds them) and
  output gates; dense MLPs where a layer has no router, else sigmoid-routed experts (a
  selection bias; renormalised and scaled where the GGUF says) beside a shared expert; SwiGLU
  clamped per layer; Llama 3's RoPE scaling (``rope_freqs``) in the global layers; the NextN
  blocks dropped.
* ``nanbeige``: q/k un-permuted, its stack run ``num_loops`` times with the final norm between
  the loops unless ``skip_loop_final_norm``; no biases, no RoPE scaling.
* ``granitehybrid`` (Granite 4.0 H-Tiny/H-Small/H-Micro, ``granitemoehybrid``): Mamba-2 layers
  where llama.cpp gives no key/value heads, attention (RoPE where ``rope.scaling.finetuned``,
  none otherwise) in the others; Granite's multipliers (llama.cpp's 0 or none: no scaling);
  A_log of llama.cpp's -exp(A_log), the conv kernels in MLX's layout, A, D and the gated norm
  as vectors; a dense MLP, or softmax-routed experts beside a shared MLP (its gate and up fused
  as mlx-lm's ``input_linear``); an inner size of twice the hidden one (as llama.cpp requires),
  one SSM group (as Granite 4.0's: mlx-lm's gated norm spans all groups, llama.cpp's each).
* ``chatglm`` (GLM-4-9B, ChatGLM; mlx-lm's ``glm``): q/k/v separate or fused (``attn_qkv``, cut
  apart as phi2's), their biases where the tensors have them, traditional RoPE (as they are)
  over each whole head only (mlx-lm's glm turns every dim: a GGUF that turns a part, as GLM-4-9B's
  own do, is refused), the MLP's gate and up fused as mlx-lm's ``gate_up_proj``, a tied or untied
  head.
* ``dbrx`` (DBRX): the fused ``attn_qkv`` as mlx-lm's ``Wqkv``, clipped at ``clamp_kqv`` (required
  by llama.cpp, and positive: mlx-lm's dbrx always clips), LayerNorms without biases at
  mlx-lm's hard-wired epsilon (1e-5), NeoX RoPE over each whole head, softmax-routed experts
  (renormalised top weights, as both compute them) whose stacks are cut into mlx-lm's experts.
* ``phimoe`` (Phi-3.5-MoE): Mixtral's tensors with Phi-3's LongRoPE (its scale llama.cpp's
  ``attn_factor``), biases on q/k/v, the output projection and the head, normed by mlx-lm's
  phimoe as the checkpoint is: LayerNorms (with biases) and sparsemixer routing, where
  llama.cpp's graph takes RMS norms (with the same biases) and softmax top-k routing, so the two
  differ.
* ``jamba`` (AI21 Jamba without experts, ``jamba``): Mamba layers where llama.cpp gives no
  key/value heads, attention without RoPE in the others, a dense MLP in every layer; A_log of
  llama.cpp's -exp(A_log), the conv kernels in MLX's layout; an inner size of twice the hidden
  one (as llama.cpp requires). Experts are refused: llama.cpp weighs the chosen ones by their
  softmax over all experts, mlx-lm's jamba renormalises over the chosen ones.
* ``deci`` (Llama-3.1/3.3-Nemotron Nano/Super/Ultra, ``nemotron-nas``): each layer's heads,
  key/value heads and MLP width (llama.cpp's arrays) as ``block_configs``: no heads, no
  attention; heads without key/value heads, one linear map (its ``attn_output``); no MLP width,
  no MLP (where such a layer has attention, llama.cpp's graph drops the layer's whole output,
  mlx-lm's and Hugging Face's keep its attention); q/k un-permuted; Llama 3's ``rope_freqs``.
* ``laguna`` (Poolside Laguna-XS.2, S.2): query heads by layer, the output gate per head
  (``attn_gate``; Laguna-M.1's per-element gate refused: mlx-lm's laguna has none), sliding
  layers by llama.cpp's pattern (a period of 4, a global layer first, unless given) with plain
  RoPE over ``rope.dimension_count_swa`` dims at ``rope.freq_base_swa``, YaRN (or plain RoPE)
  over ``rope.dimension_count`` dims in the global ones; leading dense layers, then
  sigmoid-routed experts (a correction bias, the top weights renormalised, as mlx-lm's are)
  beside a shared expert.
* ``talkie`` (``talkie``): its gains (per query head: ``attn_q_norm``; each branch's: the
  ``.scale`` of ``attn_output`` and ``ffn_down``; the embeddings added back:
  ``layer_output_scale``; the head's: the metadata's ``logit_scale``) as mlx-lm's parameters,
  the q/k rows' second halves negated back (llama.cpp's converter negates them to turn
  Talkie's RoPE of negated frequencies into NeoX's), the head a bare matrix; no grouped
  key/value heads, as mlx-lm's talkie has none.
* ``bailingmoe`` / ``bailingmoe2`` (Ling/Ring 1, Ling/Ring 2.0; mlx-lm's ``bailing_moe``): q/k/v
  fused as ``query_key_value`` (Ling 1's un-permuted first, llama.cpp's converter having cut
  them apart), DeepSeek's MoE reading beside shared experts (of their own width where the GGUF
  says); Ling 1: softmax routing, full NeoX RoPE; Ling 2.0: leading dense layers, sigmoid
  routing with the optional selection bias, expert groups, q/k norms, NeoX RoPE over part of
  each head, the NextN block dropped. No biases (llama.cpp reads none).
* ``nemotron_h_moe`` (Nemotron-H MoE, Nemotron 3 Nano; mlx-lm's ``nemotron_h``): a mixer a
  layer by llama.cpp's per-layer counts: Mamba-2 (no key/value heads nor feed-forward width;
  A_log of llama.cpp's -exp(A_log), the conv kernels in MLX's layout, A, D and the gated norm
  as vectors, its groups as llama.cpp's), attention without RoPE, or sigmoid-routed
  squared-ReLU experts with their correction bias (DeepSeek's MoE reading), through latent
  projections where ``moe_latent_size`` says, beside a shared expert; the NextN block dropped.

* ``plamo`` (PLaMo 1): attention and a SwiGLU MLP in parallel on one norm, NeoX RoPE; the query
  heads llama.cpp's converter put in grouped-query order (and the output projection's columns)
  back in mlx-lm's, whose ``n_shared_head`` (heads / key/value heads) tiles the key/value heads.
* ``plamo3`` (PLaMo 3): a fused q/k/v, per-head q/k norms, four norms a layer, a fused gate/up;
  each norm's weight less the offset llama.cpp's converter added (PLaMo 2's, and 1 on the q/k
  norms); sliding layers by llama.cpp's pattern (flags, or a period: 8 unless given), which must
  make every p-th layer global as mlx-lm's plamo3 does, their window and RoPE base
  (``rope.freq_base_swa``, else the global one); none without a window. Its vocabulary
  (``tokenizer.ggml.model`` "plamo2") is not converted, as PLaMo 2's.
* ``muse-glimmer`` (Muse Glimmer's text model, ``muse_glimmer``): q/k un-permuted, the four norms
  around each branch stored as 1 + w (the final one as w), the q/k norm weights llama.cpp's
  converter makes of ``qk_scale_factor`` (every query weight) and ones (the keys') read back as
  that factor (any others refused), sliding-window layers by llama.cpp's pattern (flags, or a
  period: 4 unless given) with RoPE at ``rope.freq_base_swa``, global ones without; the logits
  times ``logit_scale`` and soft-capped (a GGUF without a cap refused: mlx-lm's model caps).
* ``spark2_5`` (Spark 2.5): the fused ``attn_qkv`` as mlx-lm's ``q_k_v_proj``, the output gate
  per head, sliding-window layers by a flag each, each kind of layer with its RoPE (the global
  ones' ``rope.dimension_count`` and ``rope.freq_base``, the sliding ones' ``_swa`` keys);
  mlx-lm's exact GELU where llama.cpp's graph takes its tanh approximation (the two differ by
  about 1e-3 of an activation).

Refused with the reason (:data:`UNSUPPORTED_ARCHITECTURES`): ``hunyuan-moe`` (Hunyuan-A13B:
llama.cpp renormalises the chosen experts' weights, mlx-lm's ``hunyuan`` does not), ``bitnet``
(BitNet b1.58: llama.cpp's graph gates its MLP with SiLU, mlx-lm's ``bitnet`` with ReLU^2),
``deepseek4`` (DeepSeek-V4: position embeddings on its compressed groups, the indexer's own
compressor, experts routed by token id, a hyper-connection head; not mlx-lm's ``deepseek_v41``).
* ``nemotron_h`` (Nemotron-H, Nemotron Nano 2): a mixer a layer, by llama.cpp's per-layer
  key/value heads and MLP widths: Mamba-2 (neither), attention without RoPE (heads, no MLP) or a
  squared-ReLU MLP (a width); A_log of llama.cpp's -exp(A_log), the conv kernels in MLX's layout,
  A, D and the group-wise gated norm as vectors; biases where the tensors have them, the
  embedding as the head where the GGUF has none. Experts (Nemotron 3 Nano's ``nemotron_h_moe``)
  and an attention scale other than 1/sqrt(head_dim) are refused.
* ``plamo2`` (PLaMo 2): Mamba layers where llama.cpp gives no key/value heads, attention (a
  fused q/k/v, per-head q/k norm weights, NeoX RoPE) in the others, placed every
  ``mamba_step``-th as mlx-lm's plamo2 places them (another layout refused); each norm's weight
  less the offset llama.cpp's converter added, A_log of its -exp(A_log), the conv kernels in
  MLX's layout; a RoPE base other than 10000 refused (its q/k norms' epsilon is mlx-lm's 1e-6,
  llama.cpp's the GGUF's). (mlx-lm's plamo2 clamps each time step to [0.001, 100], llama.cpp's does
  not.) llama.cpp's PLaMo 2 vocabulary (``tokenizer.ggml.model`` "plamo2") is not converted.
* ``falcon-h1`` (Falcon-H1, ``falcon_h1``): Mamba-2 beside attention (NeoX RoPE) in every layer,
  a SwiGLU MLP; its multipliers as llama.cpp's converter folded them into the tensors, the head
  its own (the embedding's where the GGUF has none); A_log of llama.cpp's -exp(A_log), the conv
  kernels in MLX's layout; the gated norm where the GGUF has one, over one SSM group only
  (mlx-lm's spans all groups, llama.cpp's each); an attention scale other than 1/sqrt(head_dim)
  refused.
* ``kimi-linear`` (Kimi Linear, ``kimi_linear``): Kimi Delta Attention layers where llama.cpp
  gives no key/value heads (A_log of llama.cpp's -exp(A_log), the conv kernels in MLX's layout,
  ``ssm_dt.bias`` the gate's ``dt_bias``), absorbed latent attention without RoPE in the others
  (``attn_k_b`` / ``attn_v_b`` as ``embed_q`` / ``unembed_out``), experts (sigmoid or softmax
  routing with the selection bias, renormalised, times ``expert_weights_scale``) beside shared
  ones from ``leading_dense_block_count`` on; low-rank queries (mlx-lm's model projects them in
  one step) and one expert per token (llama.cpp renormalises its weight to 1) refused. The
  KDA q/k L2 norms take mlx-lm's 1e-6 (llama.cpp's the GGUF's RMS epsilon, Kimi Linear's 1e-5).
* ``kimi-k3`` (Kimi K3's text model, ``kimi_k3``): Kimi Linear's reading, low-rank queries too,
  the KDA layers' q/k/v and conv kernels fused as mlx-lm's (``qkv_proj``, ``qkv_conv``), their
  full-rank gate ``ssm_g`` and ``kda.gate_lower_bound``; the latent attention's output gate
  ``attn_gate``; sigmoid-routed experts on an ``expert_latent_length`` latent (``ffn_routed_*``),
  renormalised where ``expert_weights_norm``; SiTU (``activation.situ_*beta``); attention
  residuals in blocks of ``attn_res.block_size``, each fused score (``*_res_score``) a res_proj
  under a norm of ones. What one config cannot say for every layer is refused by the shapes.

Every failure on bad metadata is a :class:`UserInputError` with a one-line message.
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (must precede any mlx import)

import importlib
import math
from functools import partial
from statistics import NormalDist
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import UserInputError, shown
from .gguf_tensors import BAILING, DELTA_NET, NEXTN, QWEN35, dequantized, nextn_blocks

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "olmo2": "Olmo2ForCausalLM",
                 "exaone4": "Exaone4ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM",
                 "glm4moe": "Glm4MoeForCausalLM",
                 "gemma4": "Gemma4ForCausalLM",
                 "gemma3n": "Gemma3nForConditionalGeneration",
                 "seed_oss": "SeedOssForCausalLM",
                 "ernie4_5": "Ernie4_5_ForCausalLM",
                 "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
                 "mistral3": "Ministral3ForCausalLM",
                 "deepseek2": "DeepseekV2ForCausalLM",
                 "glm4": "Glm4ForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                 "cohere2": "Cohere2ForCausalLM", "apertus": "ApertusForCausalLM",
                 "exaone": "ExaoneForCausalLM", "lfm2": "Lfm2ForCausalLM",
                 "lfm2moe": "Lfm2MoeForCausalLM", "granitehybrid": "GraniteMoeHybridForCausalLM",
                 "hunyuan-dense": "HunYuanDenseV1ForCausalLM",
                 "stablelm": "StableLmForCausalLM", "minicpm": "MiniCPMForCausalLM",
                 "dots1": "Dots1ForCausalLM", "llama4": "Llama4ForConditionalGeneration",
                 "gemma": "GemmaForCausalLM", "command-r": "CohereForCausalLM",
                 "phi2": "PhiForCausalLM", "gptneox": "GPTNeoXForCausalLM",
                 "internlm2": "InternLM2ForCausalLM", "qwen": "QWenLMHeadModel",
                 "gpt2": "GPT2LMHeadModel", "starcoder": "GPTBigCodeForCausalLM",
                 "nemotron": "NemotronForCausalLM", "openelm": "OpenELMForCausalLM",
                 "deepseek": "DeepseekForCausalLM", "mellum": "MellumForCausalLM",
                 "nanbeige": "NanbeigeForCausalLM",
                 "minicpm3": "MiniCPM3ForCausalLM", "chatglm": "GlmForCausalLM",
                 "jamba": "JambaForCausalLM", "mistral4": "Mistral4ForCausalLM",
                 "exaone-moe": "ExaoneMoEForCausalLM", "afmoe": "AfmoeForCausalLM",
                 "qwen2vl": "Qwen2ForCausalLM", "qwen3vl": "Qwen3ForCausalLM",
                 "qwen3vlmoe": "Qwen3MoeForCausalLM", "dbrx": "DbrxForCausalLM",
                 "phimoe": "PhiMoEForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM",
                 "minimax-m3": "MiniMaxM3SparseForConditionalGeneration",
                 "mimo2": "MiMoV2FlashForCausalLM", "step35": "Step3p5ForCausalLM",
                 "deci": "DeciLMForCausalLM", "talkie": "TalkieForCausalLM",
                 "laguna": "LagunaForCausalLM",
                 "bailingmoe": "BailingMoeForCausalLM",
                 "bailingmoe2": "BailingMoeV2ForCausalLM",
                 "nemotron_h_moe": "NemotronHForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM", "falcon-h1": "FalconH1ForCausalLM",
                 "plamo2": "Plamo2ForCausalLM", "plamo": "PlamoForCausalLM",
                 "plamo3": "Plamo3ForCausalLM", "deepseek32": "DeepseekV32ForCausalLM",
                 "glm-dsa": "GlmMoeDsaForCausalLM", "kimi-linear": "KimiLinearForCausalLM",
                 "kimi-k3": "KimiK3ForConditionalGeneration",
                 "bailingmoe3": "BailingMoeV3ForCausalLM",
                 "muse-glimmer": "MuseGlimmerForConditionalGeneration",
                 "spark2_5": "Spark2_5ForCausalLM"}
#: llama.cpp architectures that no mlx-lm model computes, and why (each refused in one line)
UNSUPPORTED_ARCHITECTURES = {
    "hunyuan-moe": "llama.cpp renormalises the chosen experts' weights, mlx-lm's hunyuan does not",
    "bitnet": "llama.cpp's graph gates its MLP with SiLU, mlx-lm's bitnet with ReLU^2",
    "deepseek4": "llama.cpp's DeepSeek-V4 adds position embeddings to its compressed groups, "
                 "gives its indexer a compressor of its own, routes its first layers' experts "
                 "by token id and merges the streams with a hyper-connection head, none of which "
                 "mlx-lm's deepseek_v41 (DeepSeek-V4.1) has"}
# mlx-lm's model type of each GGUF architecture (the same name unless listed)
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
                "gpt-oss": "gpt_oss",
                "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next",
                "glm4moe": "glm4_moe", "gemma4": "gemma4_text", "ernie4_5-moe": "ernie4_5_moe",
                "mistral3": "ministral3", "deepseek2": "deepseek_v2", "lfm2moe": "lfm2_moe",
                "hunyuan-dense": "hunyuan_v1_dense", "command-r": "cohere",
                "phi2": "phi", "gptneox": "gpt_neox",
                "starcoder": "gpt_bigcode",
                "granitehybrid": "granitemoehybrid", "chatglm": "glm",
                "exaone-moe": "exaone_moe", "qwen2vl": "qwen2", "qwen3vl": "qwen3",
                "qwen3vlmoe": "qwen3_moe", "minimax-m2": "minimax", "mimo2": "mimo_v2_flash",
                "minimax-m3": "minimax_m3_vl",
                "step35": "step3p5", "deci": "nemotron-nas",
                **dict.fromkeys(BAILING, "bailing_moe"), "nemotron_h_moe": "nemotron_h",
                "falcon-h1": "falcon_h1", "deepseek32": "deepseek_v32", "glm-dsa": "glm_moe_dsa",
                "kimi-linear": "kimi_linear", "bailingmoe3": "bailing_moe_v3",
                "muse-glimmer": "muse_glimmer", "kimi-k3": "kimi_k3"}
# mlx-lm's switches for optional biases, each by the tensor that has one when it is on, and the
# switches of each architecture's model (llama.cpp's seed_oss and ERNIE 4.5 graphs apply q/k/v
# biases only; mlx-lm's models take every bias the GGUF holds)
_BIAS_TENSORS = {"attention_bias": "attn_q", "attention_out_bias": "attn_output",
                 "mlp_bias": "ffn_gate", "use_bias": "attn_q"}
_BIAS_SWITCHES = {**dict.fromkeys(("llama", "smollm3", "granite"), ("attention_bias", "mlp_bias")),
                  "seed_oss": ("attention_bias", "attention_out_bias", "mlp_bias"),
                  **dict.fromkeys(("ernie4_5", "ernie4_5-moe"), ("use_bias",)),
                  **dict.fromkeys(("glm4moe", "granitemoe", "glm4"), ("attention_bias",))}
# The model types whose mlx-lm models take each head hidden / heads wide (no head_dim, or one
# that must be so): sparse MoEs' and dense ones'
_HEADS_OF_HIDDEN = ("mixtral", "qwen2_moe", "granitemoe", "starcoder2", "cohere2", "apertus",
                    "lfm2", "lfm2_moe", "stablelm", "cohere", "phi", "gpt_neox", "internlm2",
                    "qwen", "gpt2", "gpt_bigcode", "deepseek", "granitemoehybrid", "jamba",
                    "dbrx", "phimoe", "bailing_moe", "plamo")
# Qwen2-VL's, Qwen3-VL's and Qwen3-VL MoE's text models: llama.cpp's M-RoPE (its sections) on
# text is their text models' NeoX RoPE (mlx-lm's qwen2, qwen3, qwen3_moe)
QWEN_VL = ("qwen2vl", "qwen3vl", "qwen3vlmoe")
# LFM2 and LFM2-MoE: short-convolution layers (no key/value heads) beside attention ones
LFM2 = ("lfm2", "lfm2moe")
# The architectures with LayerNorms, whose epsilon llama.cpp requires
_LAYER_NORM = ("starcoder2", "cohere2", "stablelm", "command-r", "phi2", "gptneox", "gpt2",
               "starcoder", "nemotron", "dbrx")
# GPT-2 and StarCoder 1: learned positions, GPT-2's config names in mlx-lm's models
LEARNED_POSITIONS = ("gpt2", "starcoder")
# Command R7B: llama.cpp's sliding-window pattern (3 local layers, then a global one) unless the
# GGUF says otherwise
COHERE2_SLIDING_PATTERN = 4
# Apertus: its xIELU activation's parameters, by llama.cpp's metadata keys (no architecture
# prefix; one value or one per layer) and mlx-lm's names
XIELU_KEYS = {"xielu.alpha_p": "alpha_p", "xielu.alpha_n": "alpha_n", "xielu.beta": "beta",
              "xielu.eps": "eps"}
# Gemma 2 and 3: the layers of the 27B, whose queries llama.cpp scales by 1/sqrt(hidden / heads)
# (by 1/sqrt(head_dim) in the others)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 2: llama.cpp's defaults where the GGUF gives no window or soft-caps (its soft-caps under
# the names mlx-lm's gemma2 and the GGUF give them)
GEMMA2_WINDOW = 4096
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# Gemma 3: llama.cpp's hard-wired sliding-window pattern (5 local layers, then a global one)
# and local RoPE base, unless the GGUF says otherwise
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma 4: llama.cpp's defaults for its local RoPE base (Gemma 3's) and logit soft-cap, and the
# divisor its converter gives the RoPE frequencies a global layer leaves unrotated (1e30: none
# below this is taken for one)
GEMMA4_LOCAL_ROPE_BASE = GEMMA3_LOCAL_ROPE_BASE
GEMMA4_LOGIT_SOFTCAP = 30.0
GEMMA4_UNROTATED = 1e29
# Gemma 3n: what llama.cpp's graph hard-wires (its converter writes some of it as metadata,
# which its loader does not read): AltUp's streams, the active one, the layers with sparse MLP
# gates and their sparsity (0.95: the gate's 1.645-sigma cut), the layers with keys and
# values of their own (those after read the last of their kind among them), the soft-cap
GEMMA3N_STREAMS = 4
GEMMA3N_SPARSE_LAYERS = 10
GEMMA3N_SPARSITY = 0.95
GEMMA3N_KV_LAYERS = 20
GEMMA3N_LOGIT_SOFTCAP = 30.0
# The architectures whose sliding-window layers turn at the global RoPE base in mlx-lm's models
# (llama.cpp's loaders read a base of their own), or in llama.cpp's graph (Mellum's, whose
# mlx-lm model would take rope.freq_base_swa)
_ONE_ROPE_BASE = ("gpt-oss", "gemma2", "mellum", "exaone-moe", "afmoe")
# Muse Glimmer: llama.cpp's sliding-window period (3 local layers, then a global one) unless the
# GGUF says otherwise, and the epsilon of the norms after each branch it hard-wires (mlx-lm's
# post_norm_eps)
MUSE_GLIMMER_SLIDING_PATTERN = 4
MUSE_GLIMMER_POST_NORM_EPS = 1e-8
# Mellum, K-EXAONE: llama.cpp's sliding-window pattern (3 local layers, then a global one)
# unless the GGUF says otherwise
MELLUM_SLIDING_PATTERN = 4
# Laguna: llama.cpp's sliding-window period (a global layer, then 3 local ones) unless the GGUF
# says otherwise
LAGUNA_SLIDING_PATTERN = 4
# AFM: llama.cpp's hard-wired period of the layers without RoPE (every 4th), and its window
# pattern's default
AFMOE_NO_ROPE_PERIOD = 4
# gpt-oss: llama.cpp's sliding-window pattern (a local layer, then a global one) unless the GGUF
# says otherwise
GPT_OSS_SLIDING_PATTERN = 2
# llama.cpp's YaRN betas: gpt-oss's (its loader reads no key for them), Ministral 3's unless the
# GGUF gives them (its mistral3 loader)
LLAMA_CPP_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
# Llama 4: llama.cpp's hard-wired chunk of its chunked-attention layers, and its attention
# temperature's floor scale and scale (the GGUF's window key only switches chunking off at 0);
# Maverick's experts, whose layers llama.cpp gives no q/k norm
LLAMA4_CHUNK = 8192
LLAMA4_TEMPERATURE = {"floor_scale": 8192, "attn_scale": 0.1}
LLAMA4_MAVERICK_EXPERTS = 128
# SmolLM3: llama.cpp hard-wires RoPE off in every 4th layer (no GGUF key holds it)
SMOLLM3_NO_ROPE_INTERVAL = 4
# EXAONE 4.0 32B (64 layers): llama.cpp's hard-wired window and pattern period (3 local layers,
# then a global one without RoPE), unless the GGUF says otherwise
EXAONE4_32B_LAYERS = 64
EXAONE4_32B_WINDOW = 4096
EXAONE4_32B_PERIOD = 4
# DBRX: the LayerNorm epsilon mlx-lm's dbrx hard-wires (nn.LayerNorm's default), as a GGUF
# stores it (llama.cpp's converter writes this one)
DBRX_LAYER_NORM_EPS = np.float32(1e-5)
# Qwen 1: the RoPE base mlx-lm's qwen hard-wires (nn.RoPE's default)
QWEN_ROPE_BASE = 10000.0
# Qwen3.5/3.6, Qwen3-Next: llama.cpp's default period of the full-attention layers
QWEN35_FULL_ATTENTION_INTERVAL = 4
# The architectures whose RoPE may turn part of each head (mlx-lm's partial_rotary_factor)
_PARTIAL_ROPE = ("phi3", *DELTA_NET, "glm4moe", "glm4", "stablelm", "phi2", "gptneox", "nemotron",
                 "minimax-m2", "mimo2", "laguna", "bailingmoe2", "spark2_5", "minimax-m3")
# llama.cpp's expert gating functions (gguf's ExpertGatingFuncType): none given is sigmoid for
# GLM-4.5 (the only one mlx-lm's glm4_moe has); softmax for deepseek2 but in GLM-4.7-Flash
_NO_GATING, _SOFTMAX_GATING, _SIGMOID_GATING = 0, 1, 2
# mlx-lm's names of llama.cpp's gating functions
_GATING_NAMES = {_SOFTMAX_GATING: "softmax", _SIGMOID_GATING: "sigmoid"}
# The architectures of multi-head latent attention
MLA = ("deepseek2", "minicpm3", "mistral4", "deepseek32", "glm-dsa", "kimi-linear",
       "bailingmoe3", "kimi-k3")
# DeepSeek's sparse attention (a lightning indexer per layer): DeepSeek-V3.2's, GLM-5's
DSA = ("deepseek32", "glm-dsa")
# MiniCPM3: the embedding, residual and logit scales llama.cpp hard-wires (its converter writes
# none), as mlx-lm's minicpm3 names them
MINICPM3_SCALES = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}
# DeepSeek-V2/V3: the RMS epsilon mlx-lm's deepseek_v2 and deepseek_v3 hard-wire for their latent
# norms (llama.cpp takes the GGUF's, as mlx-lm's glm4_moe_lite does), as a GGUF stores it
DEEPSEEK_LATENT_EPS = np.float32(1e-6)
# GLM-4.7-Flash as llama.cpp's deepseek2 loader recognises it without a gating function: its
# layers (with the NextN block or without) and vocabulary
GLM47_FLASH_LAYERS, GLM47_FLASH_VOCAB = (47, 48), 154880
# llama.cpp's converter writes DeepSeek's mscale_all_dim times 0.1 as the YaRN log multiplier
DEEPSEEK2_LOG_MUL_SCALE = np.float32(0.1)
# Phi-3's LongRoPE: llama.cpp's tensors of its factors beyond and within the original context
_LONGROPE = {"long_factor": "rope_factors_long.weight",
             "short_factor": "rope_factors_short.weight"}
# RoPE scaling held as tensors (config, not weights), and the architectures llama.cpp reads
# each for (Llama 3.1/3.2's and EXAONE 4's divisors, Phi-3's factors)
ROPE_TENSORS = {"rope_freqs.weight": ("llama", "exaone4", "apertus", "exaone", "llama4",
                                       "gemma4",  # Gemma 4: its global layers' partial RoPE
                                       "step35",  # Step-3.5: Llama 3's, in its global layers
                                       "deci"),
                **dict.fromkeys(_LONGROPE.values(), ("phi3", "minicpm3", "phimoe"))}
#: How far a GGUF's ``rope.scaling.attn_factor`` may be from mlx-lm's RoPE scale, relatively:
#: llama.cpp writes it in float32 (rounding ~6e-8), other formulas miss by percents.
ATTN_FACTOR_RTOL = 1e-6
# mlx-lm's plamo2: its RoPE's base (nn.RoPE's default)
PLAMO2_ROPE_BASE = 10000.0
# PLaMo 3: llama.cpp's sliding-window pattern (7 local layers, then a global one) unless the GGUF
# says otherwise
PLAMO3_SLIDING_PATTERN = 8
#: The largest count a GGUF's metadata may give (heads, widths, context): far above any
#: model's, far below what would make the shape check allocate without bound.
_MAX_COUNT = 2**24


def mlx_lm_config(arch: str, meta: dict, tensors: dict) -> dict:
    """mlx-lm's ``config.json`` of a GGUF of architecture ``arch``: its metadata ``meta`` and
    its ``tensors`` (by name) read as llama.cpp reads them."""
    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def count(key: str, default: Any = None, *, value: Any = None, least: int = 1) -> int:
        value = g(key, default) if value is None else value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                or not least <= value <= _MAX_COUNT:
            raise UserInputError(f"GGUF metadata {arch}.{key} must be an integer in "
                                 f"[{least}, {_MAX_COUNT}], got {shown(value, 40)}")
        return int(value)

    def optional(key: str) -> int:
        """A count llama.cpp takes as 0 when the GGUF has none."""
        return count(key, 0, least=0)

    def real(key: str, default: float | None = None, *, above_zero: bool = False) -> float:
        """A finite number, or a positive one (llama.cpp's default where the GGUF has none)."""
        value = g(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
                or not np.isfinite(value) or (above_zero and value <= 0):
            raise UserInputError(f"GGUF metadata {arch}.{key} must be a "
                                 f"{'positive' if above_zero else 'finite'} number, got "
                                 f"{shown(value, 40)}")
        return float(value)

    def positive(key: str, default: float | None = None) -> float:
        return real(key, default, above_zero=True)

    def yarn_rope() -> dict:
        """llama.cpp's YaRN: its factor and original context (the context length unless the
        GGUF gives one)."""
        return {"rope_type": "yarn", "factor": positive("rope.scaling.factor", 1.0),
                "original_max_position_embeddings": count(
                    "rope.scaling.original_context_length", config["max_position_embeddings"])}

    def experts() -> tuple[int, int]:
        """The number of experts and of those each token uses."""
        total, used = count("expert_count"), count("expert_used_count")
        if used > total:
            raise UserInputError(f"GGUF metadata {arch}.expert_used_count ({used}) exceeds "
                                 f"{arch}.expert_count ({total})")
        return total, used

    required = ("attention.head_count", "embedding_length", "block_count",
                "feed_forward_length")
    if arch == "qwen35moe":  # llama.cpp's converter writes none: every layer is sparse
        required = required[:-1]
    if arch in ("gemma2", "glm4", "apertus", "exaone", *LFM2, "hunyuan-dense", "minicpm",
                "dots1", "llama4", "gemma", "internlm2", "qwen", "deepseek", "mellum", "nanbeige",
                "minicpm3", "granitehybrid", "chatglm", "jamba", "exaone-moe", "afmoe",
                "phimoe", "minimax-m2", "mimo2", "step35", "deci", "talkie", "laguna",
                *BAILING, "falcon-h1", "plamo2", "plamo", "plamo3", "kimi-linear", "bailingmoe3",
                "kimi-k3", "gemma3n", "muse-glimmer", "spark2_5", "minimax-m3"):
        # llama.cpp requires it (mlx-lm's gemma2 has no default either)
        required += ("attention.layer_norm_rms_epsilon",)
    if arch in LFM2:
        required += ("shortconv.l_cache",)
    if arch in QWEN_VL:  # llama.cpp requires them (on text every section turns alike)
        required += ("rope.dimension_sections",)
    if arch in ("granitehybrid", "jamba", "nemotron_h", "nemotron_h_moe",
                "falcon-h1", "plamo2"):
        required += tuple(f"ssm.{k}" for k in ("conv_kernel", "inner_size", "state_size",
                                               "time_step_rank", "group_count")
                          if arch != "jamba" or k != "group_count")
    if arch in ("kimi-linear", "bailingmoe3", "kimi-k3"):  # llama.cpp requires them
        required += ("ssm.conv_kernel", "kda.head_dim", "expert_gating_func")
    if arch == "kimi-k3":
        required += ("attn_res.block_size", "activation.situ_beta",
                     "activation.situ_linear_beta", "expert_shared_count")
    if arch == "bailingmoe3":
        required += ("kda.gate_lower_bound", "expert_shared_count", "leading_dense_block_count")
    if arch in ("nemotron_h", "nemotron_h_moe"):  # llama.cpp requires it (its RMS epsilon
        # where none is given)
        required += ("attention.layer_norm_epsilon",)
    if arch in _LAYER_NORM:
        required += ("attention.layer_norm_epsilon",)
    if arch == "gptneox":  # llama.cpp requires it too
        required += ("use_parallel_residual",)
    if arch == "dbrx":  # llama.cpp requires it too
        required += ("attention.clamp_kqv",)
    if any(g(k) is None for k in required):
        raise UserInputError(f"GGUF metadata lacks {arch}.{' / '.join(required)}")
    gemma4 = arch == "gemma4"  # key/value heads and MLP widths by layer: _gemma4_config's
    # (and LFM2's and Granite 4.0's, 0 in their recurrent layers: _hybrid_kv_heads)
    by_layer = gemma4 or arch in (*LFM2, "granitehybrid", "jamba", "mimo2", "step35", "deci",
                                  "nemotron_h", "nemotron_h_moe", "plamo2", "kimi-linear",
                                  "bailingmoe3", "kimi-k3")
    openelm = arch == "openelm"  # every count by layer: _openelm_config's (deci's: _deci_config's)
    heads_by_layer = openelm or arch in ("step35", "deci", "laguna", "plamo2")

    def first(key: str) -> Any:
        """OpenELM's and Step-3.5's first layer's count, deci's, Laguna's and PLaMo 2's largest
        (PLaMo 2's attention layers', 0 in its Mamba ones) (here; all of them in their
        functions)."""
        value = g(key)
        if not heads_by_layer or not isinstance(value, list) or not value:
            return value
        return max(value) if arch in ("deci", "laguna", "plamo2") else value[0]

    if (isinstance(g("attention.head_count"), list) and not heads_by_layer) or \
            (isinstance(g("attention.head_count_kv"), list) and not (by_layer or openelm)):
        raise UserInputError("GGUF with per-layer head counts is not supported")
    n_heads, hidden, n_layers = (count("attention.head_count", value=first("attention.head_count")),
                                 count("embedding_length"), count("block_count"))
    if arch in NEXTN:  # the multi-token prediction blocks after the model's own
        n_layers -= nextn_blocks(arch, meta)
    n_kv = 1 if by_layer else count("attention.head_count_kv", n_heads,
                                    value=first("attention.head_count_kv"))
    if not tensors:  # llama.cpp's ggml-vocab-*.gguf files, say
        raise UserInputError("GGUF holds no tensors: a vocabulary-only file, no weights to "
                             "convert")
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if n_layers != len(blocks):  # before a model of n_layers is built to compare shapes
        raise UserInputError(f"GGUF metadata {arch}.block_count is {n_layers}, its tensors "
                             f"hold {len(blocks)} blocks")
    if "token_embd.weight" not in tensors:
        raise UserInputError("GGUF has no token_embd.weight tensor")
    mla = arch in MLA  # its q/k heads' width under llama.cpp's MLA key, where written
    key_length = ("attention.key_length_mla"
                  if mla and g("attention.key_length_mla") is not None else "attention.key_length")
    head_dim = count(key_length) if g(key_length) is not None else hidden // n_heads
    rope_dims = count("rope.dimension_count", head_dim)
    rotary = _rotary_factor(rope_dims, head_dim)
    # mlx-lm's models of _PARTIAL_ROPE rotate the first dims of each head (Phi-4-mini: 96 of
    # 128), the others all of them (DeepSeek's the last ones: _deepseek2_config's)
    if rope_dims != head_dim and not mla and (arch not in _PARTIAL_ROPE or rope_dims % 2
                                              or rotary is None):
        raise UserInputError(f"GGUF {arch} with RoPE over {rope_dims} of each head's {head_dim} "
                             "dims is not supported")
    _check_heads_of_hidden(arch, _MODEL_TYPES.get(arch, arch), n_heads, head_dim, hidden)
    if not (gemma4 or mla or arch == "mimo2") and \
            count("attention.value_length", head_dim) != head_dim:
        raise UserInputError(f"GGUF {arch} with values {g('attention.value_length')} wide and "
                             f"keys {head_dim} wide is not supported")
    vocab = int(tensors["token_embd.weight"].shape[1])
    if len(meta.get("tokenizer.ggml.tokens") or []) > vocab:
        raise UserInputError(f"GGUF tokenizer has more tokens than the embedding's {vocab} rows")
    # llama.cpp's RoPE scaling is linear unless the GGUF names another, its factor under
    # today's key or the old one
    factor = g("rope.scaling.factor", g("rope.scale_linear"))
    scaling = g("rope.scaling.type") or ("linear" if factor not in (None, 0, 1) else None)
    # Gemma 3 4B+ (its global layers only), InternLM2, Nemotron (all of them)
    linear = arch in ("gemma3", "internlm2", "nemotron") and scaling == "linear"
    yarn = arch in ("gpt-oss", "mistral3", "deepseek2", "mistral4", "laguna", *DSA) and \
        scaling == "yarn"
    if scaling not in (None, "none") and not (linear or yarn):
        raise UserInputError(f"GGUF with RoPE scaling ({scaling}) is not supported")
    for name, owners in ROPE_TENSORS.items():
        if name in tensors and arch not in owners:
            raise UserInputError(f"GGUF {arch} with RoPE scaling ({name.removesuffix('.weight')}) "
                                 "is not supported")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        # (Nemotron-H's MLP widths by layer: _nemotron_h_config's)
        "intermediate_size": 1 if gemma4 or arch in ("nemotron_h", "nemotron_h_moe",
                                                     "gemma3n") else count(
            "feed_forward_length", hidden, value=first("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": positive("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": positive("rope.freq_base", 10000.0),
        "max_position_embeddings": count("context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    config.update({switch: f"blk.0.{_BIAS_TENSORS[switch]}.bias" in tensors
                   for switch in _BIAS_SWITCHES.get(arch, ())})
    if arch == "smollm3":
        config["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
    if arch in ("granite", "granitemoe", "cohere2") and g("logit_scale") is None:
        raise UserInputError(f"GGUF metadata lacks {arch}.logit_scale")  # llama.cpp refuses it too
    if arch in ("granite", "granitemoe"):
        # llama.cpp's switch for RoPE (its granitemoe loader reads none: RoPE in every layer)
        if arch == "granite" and not g("rope.scaling.finetuned", True):
            raise UserInputError("GGUF granite without RoPE (rope.scaling.finetuned false) is "
                                 "not supported")
        # the others as llama.cpp defaults them: no scaling, queries by 1/sqrt(head_dim)
        config.update(embedding_multiplier=positive("embedding_scale", 1.0),
                      residual_multiplier=positive("residual_scale", 1.0),
                      attention_multiplier=positive("attention.scale", head_dim ** -0.5),
                      logits_scaling=positive("logit_scale"))
    if arch == "glm4":  # RoPE as llama.cpp turns it: traditional, but NeoX with MRoPE sections
        # (GLM-4.1V's, GLM-OCR's text model, whose q/k rows its converter put in NeoX order; on
        # text every section turns by one position); a head of its own (glm4_tensors')
        sections = g("rope.dimension_sections") or []
        mrope = len(sections) > 1 and sections[0] > 0 and sections[1] > 0
        config.update(partial_rotary_factor=rotary, rope_traditional=not mrope,
                      tie_word_embeddings=False)
    if arch == "chatglm":  # q/k/v biases separate or in a fused attn_qkv (cut by phi2_tensors)
        config["attention_bias"] = any(f"blk.0.{t}.bias" in tensors for t in ("attn_q", "attn_qkv"))
    if arch == "starcoder2":  # LayerNorms; its GELU MLP and biases everywhere are hard-wired
        config.update(norm_epsilon=positive("attention.layer_norm_epsilon"),
                      hidden_act="gelu_pytorch_tanh")
    if arch == "minicpm":  # Granite's graph in llama.cpp: the embedding, each branch and the
        # logits scaled, by the GGUF's keys or MiniCPM's defaults (12, 1.4 / sqrt(layers),
        # 256 / hidden); the logits divided even where the head is the embedding (glm4_tensors
        # makes it one: mlx-lm's tied minicpm divides by nothing); queries by 1/sqrt(head_dim)
        base = hidden / positive("logit_scale", 256 / hidden)
        config.update(scale_emb=positive("embedding_scale", 12.0),
                      scale_depth=positive("residual_scale", 1.4 / math.sqrt(n_layers))
                      * math.sqrt(n_layers),
                      dim_model_base=int(base) if base.is_integer() else base,
                      tie_word_embeddings=False)
    if arch == "stablelm":  # LayerNorms with biases; llama.cpp's choices by the tensors it finds:
        # q/k/v biases, per-head q/k LayerNorms (StableLM 2 12B), no norm before the MLP being the
        # parallel residual (the metadata's use_parallel_residual unread)
        config.update(layer_norm_eps=positive("attention.layer_norm_epsilon"),
                      partial_rotary_factor=rotary, use_qkv_bias="blk.0.attn_q.bias" in tensors,
                      qk_layernorm="blk.0.attn_q_norm.weight" in tensors,
                      use_parallel_residual="blk.0.ffn_norm.weight" not in tensors)
    if arch == "dbrx":
        config.update(_dbrx_config(positive, experts, config))
    if arch == "phi2":  # LayerNorms with biases, biases everywhere, a GELU MLP: hard-wired
        config.update(layer_norm_eps=positive("attention.layer_norm_epsilon"),
                      partial_rotary_factor=rotary)
    if arch == "gptneox":
        config.update(_gptneox_config(g, count, positive, n_heads, n_kv, hidden, rotary,
                                      config["rope_theta"]))
    if arch == "cohere2":
        config.update(_cohere2_config(g, count, real, positive, n_layers))
    if arch == "command-r":  # cohere2's reading (its logit scale optional in llama.cpp: none,
        # or 0, is 1); q/k LayerNorms where the GGUF has them (llama.cpp's Command R+, 64 layers)
        config.update(layer_norm_eps=positive("attention.layer_norm_epsilon"),
                      layer_norm_bias=False, attention_bias=False,
                      logit_scale=real("logit_scale", 0.0) or 1.0,
                      use_qk_norm="blk.0.attn_q_norm.weight" in tensors)
    if arch in LEARNED_POSITIONS:
        config.update(_gpt2_config(arch, n_heads, n_kv, positive, config))
    if arch == "apertus":  # llama.cpp reads no biases, hard-wires q/k norms and NeoX RoPE
        _check_attention_scale(arch, real, head_dim, "apertus")
        xielu_parameters(meta, n_layers)  # required by llama.cpp: refused here, not half-written
        config.update(mlp_bias=False, attention_bias=False, post_norm=False, qk_norm=True)
    if arch == "exaone":  # mlx-lm's exaone by its own names; llama.cpp reads no MLP or output
        # biases (q/k/v ones it would, which mlx-lm's model takes with an output one: refused)
        config.update(num_layers=n_layers, layer_norm_epsilon=config["rms_norm_eps"],
                      attention_bias=False, mlp_bias=False)
    if arch == "hunyuan-dense":  # q/k norms (after RoPE in both) hard-wired in llama.cpp; its
        # q/k/v biases, which mlx-lm's model takes only with an output one llama.cpp never reads,
        # refused by the shape check; NTK-alpha RoPE (its converter folds alpha into the base; a
        # GGUF's rope.scaling.alpha llama.cpp's loader folds in the same way)
        alpha = real("rope.scaling.alpha", 0.0)
        if alpha > 0:
            config["rope_theta"] *= alpha ** (head_dim / (head_dim - 2))
        config.update(attention_bias=False, use_qk_norm=True)
    if arch == "internlm2":  # llama.cpp reads no output bias (q/k/v ones internlm2_tensors
        # refuses: mlx-lm's model takes them only with one)
        config.update(bias=False, rope_scaling={"type": "linear", "factor": float(factor)}
                      if linear else None)
    if arch == "qwen":  # mlx-lm's qwen: no key/value head count, a RoPE base of its own; the
        # c_attn bias and no other (no_bias), as llama.cpp reads them
        if n_kv != n_heads:
            raise UserInputError(f"GGUF qwen with {n_kv} key/value heads to {n_heads} heads is "
                                 "not supported (mlx-lm's qwen has no grouped-query attention)")
        if config["rope_theta"] != QWEN_ROPE_BASE:
            raise UserInputError(f"GGUF qwen with RoPE base {config['rope_theta']:g} is not "
                                 f"supported (mlx-lm's qwen turns at {QWEN_ROPE_BASE:g})")
        config.update(layer_norm_epsilon=config["rms_norm_eps"], kv_channels=head_dim,
                      no_bias=True)
    if arch in LFM2:
        config.update(_lfm2_config(arch, g, count, optional, experts, tensors, config))
    if arch == "nemotron":  # its LayerNorms' epsilon; the switches for the biases it holds
        # (mlx-lm's one for q/k/v and o_proj, one for the MLP: any other mix fails the shape
        # check); RoPE's linear scaling under the key mlx-lm's nemotron reads
        config.update(norm_eps=positive("attention.layer_norm_epsilon"), hidden_act="relu2",
                      partial_rotary_factor=rotary,
                      attention_bias="blk.0.attn_q.bias" in tensors,
                      mlp_bias="blk.0.ffn_up.bias" in tensors)
        if linear:
            config["rope_scaling"] = {"type": "linear", "factor": float(factor or 1.0)}
    if openelm:
        config.update(_openelm_config(g, count, config))
    if arch == "granitehybrid":
        config.update(_granitehybrid_config(g, count, optional, real, experts, tensors, config))
    if arch == "jamba":
        config.update(_jamba_config(g, count, tensors, config))
    if arch == "deci":
        config.update(_deci_config(g, count, config))
    if arch == "laguna":
        config.update(_laguna_config(g, count, real, positive, optional, experts, tensors, config,
                                     rotary, yarn_rope() if yarn else None))
    if arch == "talkie":  # one key/value head per query head; the head's gain (llama.cpp
        # requires it), which talkie_tensors makes a tensor
        if n_kv != n_heads:
            raise UserInputError(f"GGUF talkie with {n_kv} key/value heads to {n_heads} heads "
                                 "is not supported (mlx-lm's talkie has no grouped-query "
                                 "attention)")
        config["logit_scale"] = real("logit_scale")
    if arch == "muse-glimmer":
        config.update(_muse_glimmer_config(g, count, positive, tensors, config))
    if arch == "spark2_5":
        config.update(_spark2_5_config(g, count, positive, config, rotary))
    if arch == "falcon-h1":
        config.update(_falcon_h1_config(g, count, real, tensors, config))
    if arch == "plamo2":
        config.update(_plamo2_config(g, count, real, config))
    if arch == "plamo":  # its key/value heads tiled n_shared_head times (plamo_tensors)
        if n_heads % n_kv:
            raise UserInputError(f"GGUF plamo with {n_heads} heads over {n_kv} key/value heads "
                                 "is not supported (mlx-lm's plamo tiles them evenly)")
        config.update(n_shared_head=n_heads // n_kv, rope_traditional=False)
    if arch == "plamo3":
        config.update(_plamo3_config(g, count, positive, n_layers, config))
    if arch in ("nemotron_h", "nemotron_h_moe"):
        config.update(_nemotron_h_config(arch, g, count, positive, optional, real, experts,
                                         tensors, config))
    if arch == "olmo2" and g("attention.sliding_window"):  # llama.cpp: a window is OLMo 3's
        raise UserInputError("GGUF olmo2 with a sliding window (OLMo 3) is not supported")
    if arch == "exaone4":  # llama.cpp's 32B defaults where the GGUF gives no window or pattern
        big = n_layers == EXAONE4_32B_LAYERS
        flags = g("attention.sliding_window_pattern", EXAONE4_32B_PERIOD if big else None)
        # without a window (or a local layer) every layer is global, with RoPE
        pattern = (_sliding_pattern(flags, n_layers, arch)
                   if flags is not None and (big or g("attention.sliding_window")) else None)
        window = count("attention.sliding_window", EXAONE4_32B_WINDOW) if pattern else None
        letters = (pattern or "G") * n_layers  # a letter per layer, and more
        # layer_types for transformers' config, which loading the tokenizer reads
        config.update(rope_scaling=None, sliding_window=window, sliding_window_pattern=pattern,
                      layer_types=["sliding_attention" if c == "L" else "full_attention"
                                   for c in letters[:n_layers]])
    if arch in ("qwen3moe", "qwen3vlmoe"):  # every layer sparse, the top experts' weights
        # renormalised
        n_experts, n_used = experts()
        config.update(num_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch in ("qwen2moe", "olmoe", "granitemoe") or (arch == "llama" and
                                                        optional("expert_count")):
        config.update(_sparse_moe_config(arch, count, optional, experts, tensors, config))
    if arch in DELTA_NET:
        config.update(_delta_net_config(arch, g, count, experts, n_layers, rotary,
                                        config["rope_theta"]))
    if arch in ("dots1", "exaone-moe", "minimax-m2", "minimax-m3", "bailingmoe2"):
        # (llama.cpp aborts without a gating function)
        _check_gating(arch, config["model_type"], g("expert_gating_func"), (_SIGMOID_GATING,))
    if arch == "dots1":  # q/k norms hard-wired
        config.update(_routed_experts(arch, "dots1", g, count, positive, optional, experts,
                                      tensors, n_layers))
    if arch == "llama4":
        config.update(_llama4_config(g, count, experts, n_layers, config))
    if arch == "deepseek":  # softmax over every expert's logit, the top weights not renormalised
        # (both hard-wired in llama.cpp's graph, as in mlx-lm's deepseek); the head of its own
        # made from the embedding where the GGUF ties it (glm4_tensors); no biases (llama.cpp
        # reads no output one, mlx-lm's q/k/v ones only with it: refused by the shape check)
        n_experts, n_used = experts()
        if g("expert_weights_scale", 0) not in (0, 1):
            raise UserInputError(f"GGUF deepseek with expert weights scale "
                                 f"{shown(g('expert_weights_scale'), 20)} is not supported "
                                 "(mlx-lm's deepseek does not scale its experts' weights)")
        config.update(n_routed_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      n_shared_experts=count("expert_shared_count"),
                      first_k_dense_replace=_leading_dense(arch, optional, n_layers),
                      moe_layer_freq=1, attention_bias=False, tie_word_embeddings=False)
    if arch == "mellum":  # every layer sparse, the top weights renormalised (llama.cpp's graph);
        # the window in llama.cpp's pattern (flags, or a period: 4 unless given), none without
        # a window; every layer's RoPE at rope.freq_base, as llama.cpp's graph turns them
        n_experts, n_used = experts()
        window = optional("attention.sliding_window")
        pattern = (_sliding_pattern(g("attention.sliding_window_pattern",
                                      MELLUM_SLIDING_PATTERN), n_layers, arch) if window else None)
        rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        config.update(num_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      norm_topk_prob=True, sliding_window=window if pattern else None,
                      layer_types=["sliding_attention" if c == "L" else "full_attention"
                                   for c in ((pattern or "G") * n_layers)[:n_layers]],
                      rope_parameters=dict.fromkeys(("full_attention", "sliding_attention"), rope))
    if arch == "exaone-moe":
        config.update(_exaone_moe_config(g, count, positive, optional, experts, tensors,
                                         n_layers))
    if arch == "minimax-m2":  # q/k norms over all heads, experts in every layer renormalised
        # (llama.cpp's graph hard-wires both; it reads no expert weights scale, nor does mlx-lm)
        n_experts, n_used = experts()
        config.update(num_local_experts=n_experts, num_experts_per_tok=n_used,
                      intermediate_size=count("expert_feed_forward_length"),
                      shared_intermediate_size=0, rotary_dim=rope_dims, use_qk_norm=True,
                      scoring_func="sigmoid")
    if arch == "minimax-m3":
        config.update(_minimax_m3_config(g, count, positive, optional, experts, tensors,
                                         n_layers, rope_dims))
    if arch == "mimo2":
        config.update(_mimo2_config(g, count, real, positive, experts, tensors, config, rotary))
    if arch == "step35":
        config.update(_step35_config(g, count, real, positive, experts, tensors, config,
                                     rope_dims))
    if arch in BAILING:
        config.update(_bailing_config(arch, g, count, positive, optional, experts, tensors,
                                      n_layers, rope_dims))
    if arch == "kimi-linear":
        config.update(_kimi_linear_config(g, count, real, optional, experts, tensors, config,
                                          rope_dims))
    if arch == "kimi-k3":
        config.update(_kimi_k3_config(g, count, real, positive, optional, experts, tensors,
                                      config, rope_dims))
    if arch == "bailingmoe3":
        config.update(_bailingmoe3_config(g, count, real, optional, experts, tensors, config,
                                          rope_dims))
    if arch == "afmoe":
        config.update(_afmoe_config(g, count, positive, optional, experts, tensors, n_layers))
    if arch == "nanbeige":  # its stack run num_loops times over the same weights, the final
        # norm after each loop but the last unless skip_loop_final_norm (llama.cpp: 1, false);
        # no biases (llama.cpp reads no output or MLP ones; q/k/v ones refused by the shape check)
        skip = g("skip_loop_final_norm", False)
        if not isinstance(skip, (bool, np.bool_)):
            raise UserInputError(f"GGUF metadata {arch}.skip_loop_final_norm must be true or "
                                 f"false, got {shown(skip, 40)}")
        config.update(num_loops=count("num_loops", 1), skip_loop_final_norm=bool(skip),
                      attention_bias=False, mlp_bias=False)
    if arch == "glm4moe":
        config.update(_glm4moe_config(g, count, positive, optional, experts, tensors, n_layers,
                                      rotary))
    if arch == "minicpm3":
        config.update(_minicpm3_config(g, count, tensors, config, rope_dims))
    if arch == "deepseek2":
        config.update(_deepseek2_config(meta, g, count, real, positive, optional, experts,
                                        tensors, config, rope_dims))
    if arch == "mistral4":
        config.update(_mistral4_config(g, count, positive, optional, experts, tensors, config,
                                       rope_dims))
    if arch in DSA:
        config.update(_dsa_config(arch, g, count, positive, optional, experts, tensors, config,
                                  rope_dims))
    if arch in ("deepseek2", "mistral4", *DSA):
        if yarn:  # llama.cpp's betas (its deepseek2 loader reads none); mscale as mscale_all_dim
            # (llama.cpp's special case of deepseek2), which its converter wrote times 0.1
            log_mul = real("rope.scaling.yarn_log_multiplier", 0.0)
            if not log_mul:  # llama.cpp then scales the attention by YaRN's magnitude squared
                raise UserInputError(f"GGUF {arch} with YaRN RoPE but no "
                                     "rope.scaling.yarn_log_multiplier is not supported")
            scale = float(np.float32(log_mul) / DEEPSEEK2_LOG_MUL_SCALE)
            config["rope_scaling"] = {**yarn_rope(), **LLAMA_CPP_YARN_BETAS,
                                      "mscale": scale, "mscale_all_dim": scale}
    if arch == "mistral4":  # mlx-lm's mistral4 reads rope_parameters, with the temperature
        config["rope_parameters"] = _mistral4_rope(g, count, real, config)
    if arch == "glm-dsa":  # mlx-lm's glm_moe_dsa reads its RoPE from rope_parameters only
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"],
                                     **(config.pop("rope_scaling", None) or {})}
    if arch in _ONE_ROPE_BASE and \
            g("rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
        raise UserInputError(f"GGUF {arch} with another RoPE base in its sliding-window layers "
                             "is not supported")
    if arch == "gpt-oss":  # every layer sparse; its SwiGLU's alpha and limit are hard-wired in
        # llama.cpp (1.702, 7) as in mlx-lm
        n_experts, n_used = experts()
        config.update(num_local_experts=n_experts, num_experts_per_tok=n_used,
                      intermediate_size=count("expert_feed_forward_length"),
                      **_gpt_oss_windows(g, count, n_layers))
        if yarn:  # every layer's RoPE, as in llama.cpp
            config["rope_scaling"] = {**yarn_rope(), **LLAMA_CPP_YARN_BETAS}
    if arch == "ernie4_5-moe":
        config.update(_ernie45_moe_config(count, optional, experts))
    if arch == "mistral3":  # llama.cpp's mistral3 has no sliding window (mlx-lm's has)
        if g("attention.sliding_window") is not None:
            raise UserInputError("GGUF mistral3 with a sliding window is not supported")
        # Llama 4's attention temperature over the original context (llama.cpp's floor scale)
        rope = {"rope_type": "default", "rope_theta": config["rope_theta"],
                "original_max_position_embeddings": count(
                    "rope.scaling.original_context_length", config["max_position_embeddings"]),
                "llama_4_scaling_beta": real("attention.temperature_scale", 0.0)}
        if yarn:  # llama.cpp takes YaRN's mscale as 1, its log multiplier as mscale_all_dim
            rope.update(yarn_rope(), mscale=1.0,
                        mscale_all_dim=real("rope.scaling.yarn_log_multiplier", 0.0),
                        **{key: positive(f"rope.scaling.yarn_{key}", value)
                           for key, value in LLAMA_CPP_YARN_BETAS.items()})
        config["rope_parameters"] = rope
    if arch in GEMMA_27B_LAYERS:
        scalar = hidden // n_heads if n_layers == GEMMA_27B_LAYERS[arch] else head_dim
        config.update(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar)
    if arch == "gemma2":  # its window for the record: mlx-lm's gemma2 attends over all tokens
        config.update(sliding_window=count("attention.sliding_window", GEMMA2_WINDOW),
                      **{key: positive(key, value) for key, value in GEMMA2_SOFTCAPS.items()})
    if arch == "gemma3":
        window = g("attention.sliding_window")
        if window is None:
            raise UserInputError("GGUF metadata lacks gemma3.attention.sliding_window")
        config.update(
            sliding_window=int(window), sliding_window_pattern=GEMMA3_SLIDING_PATTERN,
            rope_local_base_freq=float(g("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)))
        if linear:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor or 1.0)}
    if gemma4:
        config.update(_gemma4_config(g, count, positive, optional, experts, tensors, config))
    if arch == "gemma3n":
        config.update(_gemma3n_config(g, count, positive, optional, tensors, config))
    if arch in ("phi3", "phimoe"):  # its sliding window is ignored: llama.cpp disables it,
        # mlx-lm has none; without it llama.cpp takes the context as the original one: no
        # LongRoPE scale
        config["original_max_position_embeddings"] = count(
            "rope.scaling.original_context_length", config["max_position_embeddings"])
        if rope_dims != head_dim:
            config["partial_rotary_factor"] = rotary
        if any(name in tensors for name in _LONGROPE.values()):
            config["rope_scaling"] = _longrope_scaling(arch, tensors, rope_dims)
    if arch == "phimoe":  # mlx-lm's phimoe takes LongRoPE's scale from the config: llama.cpp's
        n_experts, n_used = experts()
        config.update(num_local_experts=n_experts, num_experts_per_tok=n_used)
        if "rope_scaling" in config:
            mscale = positive("rope.scaling.attn_factor", 1.0)
            config["rope_scaling"].update(short_mscale=mscale, long_mscale=mscale)
    if "rope_freqs.weight" in tensors and not (gemma4 or arch == "step35"):  # Llama 3.1 / 3.2
        config["rope_scaling"] = _llama3_rope_scaling(
            _rope_factors("rope_freqs.weight", tensors, head_dim), config["rope_theta"],
            head_dim)
    # llama.cpp multiplies the rotated dims of queries and keys by attn_factor (and under YaRN
    # by its own magnitude); mlx-lm by its own scale (LongRoPE's, from the contexts' ratio;
    # YaRN's mscale), 1 in the other families
    attn_factor, scale = positive("rope.scaling.attn_factor", 1.0), _rope_scale(config, rope_dims)
    magnitude = _llama_cpp_yarn_magnitude(config)
    if not math.isclose(attn_factor * magnitude, scale, rel_tol=ATTN_FACTOR_RTOL):
        times = f" (times YaRN's {magnitude:.7g})" if magnitude != 1 else ""
        raise UserInputError(f"GGUF metadata {arch}.rope.scaling.attn_factor is "
                             f"{attn_factor:.7g}{times}, mlx-lm's {config['model_type']} scales "
                             f"by {scale:.7g}")
    if arch == "minimax-m3":  # mlx-lm's minimax_m3_vl reads its text model's config
        config = {**{k: config[k] for k in ("architectures", "model_type", "vocab_size",
                                            "num_attention_heads", "num_key_value_heads")},
                  "text_config": config}
    if arch == "llama4":  # mlx-lm's llama4 reads its text model's config; transformers'
        # Llama4Config (loading the tokenizer reads it) takes no RoPE scaling beside it
        config = {**{k: config[k] for k in ("architectures", "model_type", "vocab_size",
                                            "num_attention_heads", "num_key_value_heads")},
                  "text_config": {**config, "model_type": "llama4_text"}}
    if arch == "gemma3n":  # mlx-lm's gemma3n reads its text model's config (the heads at the
        # top for the conversion's own reading)
        config = {**{k: config[k] for k in ("architectures", "model_type", "vocab_size",
                                            "num_attention_heads", "num_key_value_heads")},
                  "text_config": {**config, "model_type": "gemma3n_text"}}
    if arch == "deci" and config.get("rope_scaling"):  # Llama 3's as mlx-lm reads it first
        # (``type``); loading the tokenizer reads the config through transformers (5.x), which
        # fails on a llama3 ``rope_type`` without a model type it knows (nemotron-nas)
        config["rope_scaling"] = {**config["rope_scaling"], "type": "llama3",
                                  "rope_type": "default"}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    return config


def _gptneox_config(g: Any, count: Any, positive: Any, n_heads: int, n_kv: int, hidden: int,
                    rotary: float | None, base: float) -> dict:
    """mlx-lm's gpt_neox settings of a gptneox GGUF: its LayerNorms' epsilon, RoPE over
    ``rotary_pct`` of each head, the parallel residual llama.cpp reads; grouped key/value
    heads and an MLP other than 4 x hidden (both hard-wired in mlx-lm's model) refused."""
    parallel = g("use_parallel_residual")
    if not isinstance(parallel, (bool, np.bool_)):
        raise UserInputError(f"GGUF metadata gptneox.use_parallel_residual must be true or "
                             f"false, got {shown(parallel, 40)}")
    if n_kv != n_heads:
        raise UserInputError(f"GGUF gptneox with {n_kv} key/value heads to {n_heads} query heads "
                             "is not supported (mlx-lm's gpt_neox has one per query head)")
    if count("feed_forward_length") != 4 * hidden:
        raise UserInputError(f"GGUF gptneox with an MLP {g('feed_forward_length')} wide is not "
                             f"supported (mlx-lm's gpt_neox's is 4 x hidden: {4 * hidden})")
    return {"layer_norm_eps": positive("attention.layer_norm_epsilon"), "rotary_pct": rotary,
            "rotary_emb_base": base, "use_parallel_residual": bool(parallel)}


def _dbrx_config(positive: Any, experts: Any, config: dict) -> dict:
    """mlx-lm's dbrx settings of a DBRX GGUF under its config names: q/k/v clipped at
    ``clamp_kqv``, the experts (each MLP ``feed_forward_length`` wide); its LayerNorms' epsilon,
    which mlx-lm's dbrx hard-wires, checked (the GGUF's is that of every norm, not a general one
    that the original model overrides in some)."""
    eps = positive("attention.layer_norm_epsilon")
    if np.float32(eps) != DBRX_LAYER_NORM_EPS:
        raise UserInputError(f"GGUF dbrx with LayerNorm epsilon {eps:g} is not supported "
                             f"(mlx-lm's dbrx hard-wires {float(DBRX_LAYER_NORM_EPS):g})")
    n_experts, n_used = experts()
    return {"d_model": config["hidden_size"], "n_heads": config["num_attention_heads"],
            "n_layers": config["num_hidden_layers"], "tie_word_embeddings": False,
            "attn_config": {"kv_n_heads": config["num_key_value_heads"],
                            "clip_qkv": positive("attention.clamp_kqv"),
                            "rope_theta": config["rope_theta"]},
            "ffn_config": {"ffn_hidden_size": config["intermediate_size"],
                           "moe_num_experts": n_experts, "moe_top_k": n_used}}


def _gpt2_config(arch: str, n_heads: int, n_kv: int, positive: Any, config: dict) -> dict:
    """GPT-2's and StarCoder 1's settings under their config names: learned positions as many as
    the context (position_embd's rows, by the shape check), LayerNorms, biases everywhere (all
    required by llama.cpp); what mlx-lm's gpt2 hard-wires (as many key/value heads as query
    heads, the MLP 4 x hidden) or gpt_bigcode can hold (one key/value head or as many) checked."""
    hidden, width = config["hidden_size"], config["intermediate_size"]
    if arch == "gpt2" and (n_kv != n_heads or width != 4 * hidden):
        raise UserInputError(f"GGUF gpt2 with {n_kv} key/value heads to {n_heads} query heads "
                             f"and an MLP {width} wide is not supported (mlx-lm's gpt2 takes as "
                             f"many key/value heads and 4 x hidden: {4 * hidden})")
    if arch == "starcoder" and n_kv not in (1, n_heads):
        raise UserInputError(f"GGUF starcoder with {n_kv} key/value heads is not supported "
                             f"(mlx-lm's gpt_bigcode takes 1 or as many as its {n_heads} query "
                             "heads)")
    context = config["max_position_embeddings"]
    out = {"n_embd": hidden, "n_head": n_heads, "n_layer": config["num_hidden_layers"],
           "n_positions": context, "n_ctx": context,
           "layer_norm_epsilon": positive("attention.layer_norm_epsilon")}
    if arch == "gpt2":  # its head is the embedding (gpt2_tensors drops a copy of it)
        return {**out, "tie_word_embeddings": True}
    return {**out, "n_inner": width, "multi_query": n_kv == 1, "attention_bias": True,
            "mlp_bias": True}


def _check_heads_of_hidden(arch: str, model_type: str, heads: int, head_dim: int,
                           hidden: int) -> None:
    """Refuse heads of another width than hidden / heads where mlx-lm's ``model_type`` takes
    that width (:data:`_HEADS_OF_HIDDEN`)."""
    if model_type in _HEADS_OF_HIDDEN and head_dim * heads != hidden:
        raise UserInputError(f"GGUF {arch} with {heads} heads {head_dim} wide is not "
                             f"supported (mlx-lm's {model_type} takes hidden / heads: "
                             f"{hidden / heads:g})")


def xielu_parameters(meta: dict, n_layers: int) -> dict[str, list[float]]:
    """Apertus's xIELU parameters of each layer, as its checkpoint holds them (llama.cpp's
    converter writes them so; both models take softplus of the alphas): mlx-lm's name ->
    a value per layer, from llama.cpp's keys (:data:`XIELU_KEYS`), which it requires."""
    out = {}
    for key, name in XIELU_KEYS.items():
        value = meta.get(key)
        values = value if isinstance(value, list) else [value] * n_layers
        if len(values) != n_layers or not all(
                isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))
                and np.isfinite(v) for v in values):
            raise UserInputError(f"GGUF metadata {key} must be a number or one per layer "
                                 f"({n_layers}), got {shown(value, 40)}")
        out[name] = [float(v) for v in values]
    return out


def _plamo3_config(g: Any, count: Any, positive: Any, n_layers: int, config: dict) -> dict:
    """mlx-lm's plamo3 settings of a PLaMo 3 GGUF, read as llama.cpp reads it: without a window
    every layer global; with one, sliding layers by its pattern (flags or a period, 8 unless
    given), every p-th layer global (:func:`_global_period`), at ``rope.freq_base_swa`` (else the
    global base)."""
    window = count("attention.sliding_window", 0, least=0)
    if not window:
        return {"window_size": config["max_position_embeddings"], "sliding_window_pattern": 1}
    return {"window_size": window, "rope_local_theta": positive("rope.freq_base_swa",
                                                                config["rope_theta"]),
            "sliding_window_pattern": _global_period(
                "plamo3", g("attention.sliding_window_pattern", PLAMO3_SLIDING_PATTERN),
                n_layers)}


def _global_period(arch: str, pattern: Any, n_layers: int) -> int:
    """The period p of a GGUF's sliding-window pattern (:func:`_local_layers`) that makes every
    p-th layer global and the others sliding, as mlx-lm's cohere2 and plamo3 place them; another
    pattern refused."""
    local = _local_layers(pattern, n_layers, arch)
    period = local.index(False) + 1 if False in local else None
    if period is None or local != [(i + 1) % period != 0 for i in range(n_layers)]:
        raise UserInputError(f"GGUF {arch} with sliding-window pattern {shown(pattern, 40)} "
                             f"is not supported (mlx-lm's {arch} makes every p-th layer "
                             "global, the others sliding)")
    return period


def _cohere2_config(g: Any, count: Any, real: Any, positive: Any, n_layers: int) -> dict:
    """mlx-lm's cohere2 settings of a Command R7B GGUF, read as llama.cpp reads it: LayerNorms
    without biases (llama.cpp's converter drops Cohere's zero ones, its loader reads none);
    the logits times ``logit_scale`` (0: unscaled); sliding layers by llama.cpp's pattern (a
    flag per layer or a period, 4 where the GGUF gives none), which must be mlx-lm's: every
    p-th layer global, without RoPE in both. (llama.cpp's graph turns the sliding layers at
    ``rope.freq_base``: it reads ``rope.freq_base_swa`` but uses it nowhere.)"""
    period = _global_period(
        "cohere2", g("attention.sliding_window_pattern", COHERE2_SLIDING_PATTERN), n_layers)
    return {"layer_norm_eps": positive("attention.layer_norm_epsilon"),
            "layer_norm_bias": False, "attention_bias": False,
            "logit_scale": real("logit_scale") or 1.0,
            "sliding_window": count("attention.sliding_window"),
            "sliding_window_pattern": period}


def _hybrid_kv_heads(arch: str, g: Any, count: Any, config: dict, recurrent: str) -> list[int]:
    """Each layer's key/value heads in a hybrid GGUF, as llama.cpp reads its
    ``attention.head_count_kv`` (one value, or one per layer): 0 in a ``recurrent`` layer;
    refused unless both kinds are there (mlx-lm's models index one of each) with one count in
    every attention layer (mlx-lm's)."""
    n_layers, model_type = config["num_hidden_layers"], config["model_type"]
    value = g("attention.head_count_kv", config["num_attention_heads"])
    values = value if isinstance(value, list) else [value] * n_layers
    if len(values) == g("block_count"):  # and a NextN block's after the model's (Nemotron-H's)
        values = values[:n_layers]
    if len(values) != n_layers:
        raise UserInputError(f"GGUF metadata {arch}.attention.head_count_kv has {len(values)} "
                             f"values for {n_layers} layers")
    kv = [count("attention.head_count_kv", value=v, least=0) for v in values]
    attention = [n for n in kv if n]
    if len(attention) in (0, n_layers) or len(set(attention)) > 1:
        what = (f"{len(attention)} attention layers of {n_layers}" if len(set(attention)) < 2
                else "attention layers of " + " and ".join(map(str, sorted(set(attention))))
                + " key/value heads")
        raise UserInputError(f"GGUF {arch} with {what} is not supported (mlx-lm's {model_type} "
                             f"takes {recurrent} and attention layers, one count of key/value "
                             "heads)")
    return kv


def _granitehybrid_config(g: Any, count: Any, optional: Any, real: Any, experts: Any,
                          tensors: dict, config: dict) -> dict:
    """mlx-lm's granitemoehybrid settings of a Granite 4.0 GGUF, read as llama.cpp reads it: a layer
    without key/value heads is Mamba-2 (heads ``ssm.time_step_rank`` in one group, as Granite 4.0's:
    mlx-lm normalises the gated output over all groups at once, llama.cpp group by group; an inner
    size twice the hidden one, as llama.cpp requires), the others attention, with RoPE unless
    ``rope.scaling.finetuned`` is false; biases where the tensors have them; each head's time step
    unclamped; Granite's multipliers, each 0 or missing taken as llama.cpp takes it (no scaling;
    queries by 1/sqrt(head_dim)); with experts (softmax over the top ones, as mlx-lm's), a shared
    MLP beside them (mlx-lm's model always has one)."""
    kv = _hybrid_kv_heads("granitehybrid", g, count, config, "Mamba-2")
    heads, inner, groups = (count(f"ssm.{k}") for k in ("time_step_rank", "inner_size",
                                                         "group_count"))
    if groups != 1:  # Granite 4.0's have one
        raise UserInputError(f"GGUF granitehybrid with {groups} SSM groups is not supported "
                             "(mlx-lm's granitemoehybrid normalises the gated SSM output over "
                             "all groups at once, llama.cpp group by group)")
    if inner % heads or inner != 2 * config["hidden_size"]:
        raise UserInputError(f"GGUF granitehybrid with an SSM inner size of {inner} for {heads} "
                             "heads is not supported (the inner size must be twice the hidden "
                             f"size {config['hidden_size']} and a multiple of the heads)")
    def has(role: str) -> bool:
        return any(name.endswith(f".{role}") for name in tensors)

    out = {"num_key_value_heads": next(n for n in kv if n),
           "layer_types": ["attention" if n else "mamba" for n in kv],
           "position_embedding_type": "rope" if g("rope.scaling.finetuned", True) else "nope",
           "attention_bias": has("attn_q.bias"), "mlp_bias": has("ffn_gate.bias"),
           "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_n_groups": groups,
           "mamba_d_state": count("ssm.state_size"), "mamba_d_conv": count("ssm.conv_kernel"),
           "mamba_conv_bias": has("ssm_conv1d.bias"), "mamba_proj_bias": False,
           # llama.cpp's dt unclamped (transformers' limits are 0 and inf; mlx-lm's default
           # clamps to [0.001, 100])
           "time_step_limit": [0.0, float(np.finfo(np.float32).max)],
           "embedding_multiplier": real("embedding_scale", 0.0) or 1.0,
           "residual_multiplier": real("residual_scale", 0.0) or 1.0,
           "logits_scaling": real("logit_scale", 0.0) or 1.0,
           "attention_multiplier": real("attention.scale", 0.0) or config["head_dim"] ** -0.5}
    if not optional("expert_count"):
        return out
    shared = optional("expert_shared_feed_forward_length")
    if not shared:
        raise UserInputError("GGUF granitehybrid with experts but no shared MLP is not "
                             "supported (mlx-lm's granitemoehybrid has one beside them)")
    n_experts, n_used = experts()
    return {**out, "num_local_experts": n_experts, "num_experts_per_tok": n_used,
            "shared_intermediate_size": shared}


def _jamba_config(g: Any, count: Any, tensors: dict, config: dict) -> dict:
    """mlx-lm's jamba settings of a Jamba GGUF, read as llama.cpp reads it: a layer without
    key/value heads is Mamba (an inner size twice the hidden one, as llama.cpp requires; the
    conv's bias, which llama.cpp requires, and no projection biases), the others attention
    without RoPE; a dense MLP in every layer (experts refused: llama.cpp weighs the chosen ones
    by their softmax over all experts, mlx-lm's jamba renormalises over the chosen ones)."""
    kv = _hybrid_kv_heads("jamba", g, count, config, "Mamba")
    if any(name.endswith(".ffn_gate_inp.weight") for name in tensors):
        raise UserInputError("GGUF jamba with experts is not supported (llama.cpp weighs the "
                             "chosen experts by their softmax over all of them, mlx-lm's jamba "
                             "renormalises over the chosen ones)")
    inner, hidden = count("ssm.inner_size"), config["hidden_size"]
    if inner != 2 * hidden:
        raise UserInputError(f"GGUF jamba with an SSM inner size of {inner} is not supported "
                             f"(llama.cpp requires twice the hidden size {hidden})")
    # the attention layers as mlx-lm's jamba (and transformers' config) place them: every
    # attn_layer_period-th from attn_layer_offset
    attention = [i for i, n in enumerate(kv) if n]
    offset = attention[0]
    period = attention[1] - offset if len(attention) > 1 else len(kv)
    if offset >= period or attention != list(range(offset, len(kv), period)):
        raise UserInputError(f"GGUF jamba with attention in layers {shown(attention, 40)} is "
                             "not supported (mlx-lm's jamba takes them every "
                             "attn_layer_period-th layer from attn_layer_offset)")
    return {"num_key_value_heads": kv[offset], "attn_layer_offset": offset,
            "attn_layer_period": period, "expert_layer_offset": 0, "expert_layer_period": 1,
            "num_experts": 1,
            "num_experts_per_tok": 1, "mamba_expand": 2, "mamba_d_conv": count("ssm.conv_kernel"),
            "mamba_d_state": count("ssm.state_size"), "mamba_dt_rank": count("ssm.time_step_rank"),
            "mamba_conv_bias": True, "mamba_proj_bias": False}


def _check_attention_scale(arch: str, real: Any, head_dim: int, model_type: str) -> None:
    """Refuse a GGUF whose ``attention.scale`` is not 1/sqrt(head_dim), mlx-lm's (llama.cpp's
    0 or none is that too)."""
    scale = real("attention.scale", 0.0)
    if scale and not math.isclose(scale, head_dim ** -0.5, rel_tol=ATTN_FACTOR_RTOL):
        raise UserInputError(f"GGUF {arch} with attention scale {scale:.7g} is not supported "
                             f"(mlx-lm's {model_type} scales by 1/sqrt({head_dim}))")


def _falcon_h1_config(g: Any, count: Any, real: Any, tensors: dict, config: dict) -> dict:
    """mlx-lm's falcon_h1 settings of a Falcon-H1 GGUF, read as llama.cpp reads it: Mamba-2
    (``ssm.time_step_rank`` heads) beside attention (NeoX RoPE) in every layer, a SwiGLU MLP;
    the multipliers are in the tensors (llama.cpp's converter folds them in, the head's too), so
    the head is one of its own (the embedding's where the GGUF has none: llama.cpp's, unscaled);
    the gated norm where the GGUF has one, gating first as llama.cpp's, over one group only
    (mlx-lm's spans all groups at once, llama.cpp's each); the conv's and the MLP's biases where
    the tensors have them."""
    def has(role: str) -> bool:
        return any(name.endswith(f".{role}") for name in tensors)

    _check_attention_scale("falcon-h1", real, config["head_dim"], "falcon_h1")
    heads, inner, groups = (count(f"ssm.{k}") for k in ("time_step_rank", "inner_size",
                                                         "group_count"))
    if inner % heads or heads % groups:
        raise UserInputError(f"GGUF falcon-h1 with an SSM inner size of {inner} for {heads} "
                             f"heads in {groups} groups is not supported (each must divide it)")
    norm = has("ssm_norm.weight")
    if norm and groups != 1:
        raise UserInputError(f"GGUF falcon-h1 with a gated norm over {groups} SSM groups is not "
                             "supported (mlx-lm's falcon_h1 normalises all groups at once, "
                             "llama.cpp's each)")
    return {"mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads,
            "mamba_n_groups": groups, "mamba_d_state": count("ssm.state_size"),
            "mamba_d_conv": count("ssm.conv_kernel"), "mamba_conv_bias": has("ssm_conv1d.bias"),
            "mamba_proj_bias": False, "projectors_bias": False, "mamba_rms_norm": norm,
            "mamba_norm_before_gate": False, "attention_bias": False,
            "mlp_bias": has("ffn_gate.bias"), "tie_word_embeddings": False}


def _plamo2_config(g: Any, count: Any, real: Any, config: dict) -> dict:
    """mlx-lm's plamo2 settings of a PLaMo 2 GGUF, read as llama.cpp reads it: a layer without
    key/value heads is Mamba (``ssm.time_step_rank`` heads of head_dim, no groups, as llama.cpp
    requires), the others attention; mlx-lm's plamo2 places them by ``mamba_step`` (every
    step-th from step / 2 on), so another layout is refused, as is a RoPE base other than the
    10000 its RoPE hard-wires. (Its q/k norms take the 1e-6 mlx-lm hard-wires, PLaMo 2's own;
    llama.cpp's the GGUF's epsilon.)"""
    from mlx_lm.models.plamo2 import ModelArgs as Plamo2Args, is_mamba

    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    kv = _hybrid_kv_heads("plamo2", g, count, config, "Mamba")
    for step in range(2, 2 * n_layers + 1):
        args = Plamo2Args(num_hidden_layers=n_layers, mamba_step=step)
        if [is_mamba(args, i) for i in range(n_layers)] == [not n for n in kv]:
            break
    else:
        raise UserInputError(f"GGUF plamo2 with attention in layers "
                             f"{shown([i for i, n in enumerate(kv) if n], 40)} is not supported "
                             "(mlx-lm's plamo2 takes them every mamba_step-th layer from "
                             "mamba_step / 2)")
    heads, inner = count("ssm.time_step_rank"), count("ssm.inner_size")
    if count("ssm.group_count", least=0) or inner != heads * head_dim:
        raise UserInputError(f"GGUF plamo2 with SSM groups or an inner size of {inner} for "
                             f"{heads} heads is not supported (mlx-lm's plamo2: none, and "
                             f"heads x {head_dim})")
    if config["rope_theta"] != PLAMO2_ROPE_BASE:
        raise UserInputError(f"GGUF plamo2 with RoPE base {config['rope_theta']:g} is not "
                             f"supported (mlx-lm's plamo2 turns at {PLAMO2_ROPE_BASE:g})")
    return {"num_key_value_heads": next(n for n in kv if n), "mamba_step": step,
            "hidden_size_per_head": head_dim, "mamba_num_heads": heads,
            "mamba_d_state": count("ssm.state_size"), "mamba_d_conv": count("ssm.conv_kernel"),
            "mamba_enabled": True}


def _nemotron_h_config(arch: str, g: Any, count: Any, positive: Any, optional: Any,
                       real: Any, experts: Any, tensors: dict, config: dict) -> dict:
    """mlx-lm's nemotron_h settings of a Nemotron-H GGUF (``nemotron_h``: Nemotron-H, Nemotron
    Nano 2; ``nemotron_h_moe``: Nemotron 3 Nano), read as llama.cpp reads both: a layer with a
    feed-forward width is a squared-ReLU MLP (``nemotron_h``) or experts (``nemotron_h_moe``:
    DeepSeek's MoE reading, :func:`_routed_experts`, sigmoid routing with the correction bias,
    through the latent projections where ``moe_latent_size`` says, beside a shared squared-ReLU
    expert), else one with key/value heads attention (no RoPE, queries by 1/sqrt(head_dim) as
    mlx-lm's: another ``attention.scale`` refused), else Mamba-2 (``ssm.time_step_rank`` heads
    in ``ssm.group_count`` groups, each time step unclamped as llama.cpp's); biases where the
    tensors have them; a NextN block's entries in the per-layer arrays dropped."""
    n_layers, head_dim, moe = config["num_hidden_layers"], config["head_dim"], arch.endswith("moe")

    total = count("block_count")  # the model's layers and a NextN block's, whose entries go
    widths = _per_layer(arch, g, count, total, "feed_forward_length", least=0)[:n_layers]
    kv = _per_layer(arch, g, count, total, "attention.head_count_kv",
                    config["num_attention_heads"], least=0)[:n_layers]
    pattern = [("E" if moe else "-") if w else "*" if n else "M" for w, n in zip(widths, kv)]
    if "M" not in pattern or "*" not in pattern:
        raise UserInputError(f"GGUF {arch} with layers {''.join(pattern)} is not supported "
                             "(mlx-lm's nemotron_h indexes a Mamba-2 and an attention layer)")
    if not moe and optional("expert_count"):
        raise UserInputError("GGUF nemotron_h with experts is not supported (llama.cpp reads "
                             "them as nemotron_h_moe)")
    mlp = {w for w in widths if w}
    kv_heads = {n for n, c in zip(kv, pattern) if c == "*"}
    if (len(mlp) > 1 and not moe) or len(kv_heads) > 1:
        raise UserInputError(f"GGUF {arch} with MLP widths or key/value heads that differ by "
                             "layer is not supported (mlx-lm's nemotron_h takes one of each)")
    _check_attention_scale(arch, real, head_dim, "nemotron_h")
    heads, inner, groups = (count(f"ssm.{k}") for k in ("time_step_rank", "inner_size",
                                                         "group_count"))
    if inner % heads or heads % groups:
        raise UserInputError(f"GGUF {arch} with an SSM inner size of {inner} for {heads} "
                             f"heads in {groups} groups is not supported (each must divide it)")

    def has(role: str) -> bool:
        return any(name.endswith(f".{role}") for name in tensors)

    out = {"hybrid_override_pattern": pattern, "intermediate_size": max(mlp, default=1),
           "num_key_value_heads": kv_heads.pop(), "attention_bias": has("attn_q.bias"),
           "mlp_bias": has("ffn_up.bias"), "use_bias": False,
           "layer_norm_epsilon": real("attention.layer_norm_rms_epsilon",
                                      real("attention.layer_norm_epsilon")),
           "mamba_num_heads": heads, "mamba_head_dim": inner // heads, "n_groups": groups,
           "ssm_state_size": count("ssm.state_size"), "conv_kernel": count("ssm.conv_kernel"),
           "use_conv_bias": has("ssm_conv1d.bias"), "mamba_proj_bias": False,
           "tie_word_embeddings": False}
    if moe:
        routed = _routed_experts(arch, "nemotron_h", g, count, positive, optional, experts,
                                 tensors, n_layers, tied=True)
        out.update(intermediate_size=routed["moe_intermediate_size"],
                   moe_shared_expert_intermediate_size=count(
                       "expert_shared_feed_forward_length"),
                   moe_latent_size=optional("moe_latent_size") or None,
                   **{k: routed[k] for k in ("n_routed_experts", "num_experts_per_tok",
                                             "moe_intermediate_size", "n_shared_experts",
                                             "n_group", "topk_group", "norm_topk_prob",
                                             "routed_scaling_factor")})
    return out


def _lfm2_config(arch: str, g: Any, count: Any, optional: Any, experts: Any, tensors: dict,
                 config: dict) -> dict:
    """mlx-lm's lfm2 / lfm2_moe settings of an LFM2 GGUF, read as llama.cpp reads it: a layer
    without key/value heads (``attention.head_count_kv`` per layer: 0) is a short gated
    convolution ``shortconv.l_cache`` wide, the others attention, with one count of key/value
    heads (mlx-lm's); both kinds present (mlx-lm's model indexes one of each); the MLP's width as
    written (llama.cpp's converter has applied LFM2's auto-adjustment); no biases, the head tied
    (llama.cpp's loader reads none; mlx-lm's models always tie it); no window (mlx-lm's have
    none), causal. LFM2-8B-A1B: sigmoid-routed experts from ``leading_dense_block_count`` on,
    their top weights renormalised (hard-wired in llama.cpp), the selection bias required."""
    model_type = config["model_type"]
    kv = _hybrid_kv_heads(arch, g, count, config, "convolution")
    attention = [n for n in kv if n]
    if "output.weight" in tensors:
        raise UserInputError(f"GGUF {arch} with an output head of its own is not supported "
                             f"(mlx-lm's {model_type} ties it to the embedding)")
    if optional("attention.sliding_window"):
        raise UserInputError(f"GGUF {arch} with a sliding window is not supported")
    if not g("attention.causal", True):  # LFM2's bidirectional embedding models
        raise UserInputError(f"GGUF {arch} with non-causal attention is not supported")
    out = {"num_key_value_heads": attention[0], "norm_eps": config["rms_norm_eps"],
           "conv_bias": False, "conv_L_cache": count("shortconv.l_cache", least=2),
           "layer_types": ["full_attention" if n else "conv" for n in kv]}
    if arch == "lfm2":  # the width as it is: no auto-adjustment (multiple and multiplier unused)
        return {**out, "block_dim": config["hidden_size"],
                "block_ff_dim": config["intermediate_size"], "block_auto_adjust_ff_dim": False,
                "block_multiple_of": 1, "block_ffn_dim_multiplier": 1.0}
    _check_gating("lfm2moe", "lfm2_moe", g("expert_gating_func"), (_SIGMOID_GATING,))
    n_experts, n_used = experts()
    width = g("expert_feed_forward_length")
    widths = {count("expert_feed_forward_length", value=w)
              for w in (width if isinstance(width, list) else [width])}
    if len(widths) != 1:
        raise UserInputError("GGUF lfm2moe with experts of different widths by layer is not "
                             "supported")
    return {**out, "num_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": widths.pop(), "norm_topk_prob": True,
            "use_expert_bias": True, "routed_scaling_factor": 1.0,
            "num_dense_layers": optional("leading_dense_block_count")}


def _delta_net_config(arch: str, g: Any, count: Any, experts: Any, n_layers: int,
                      rotary: float, theta: float) -> dict:
    """mlx-lm's qwen3_5 / qwen3_5_moe / qwen3_next config of a Qwen3.5/3.6 or Qwen3-Next GGUF:
    its linear-attention (Gated DeltaNet) heads from llama.cpp's ssm keys, which layers attend
    fully, the partial RoPE (Qwen3.5's: llama.cpp's interleaved MRoPE, on text every section
    turning by the same position: plain RoPE over the rotated dims), and the MoE's experts and
    shared expert."""
    n_v, n_k = count("ssm.time_step_rank"), count("ssm.group_count")
    inner = count("ssm.inner_size")
    if n_v % n_k or inner % n_v:
        raise UserInputError(f"GGUF metadata {arch}.ssm.time_step_rank ({n_v}) must be a "
                             f"multiple of {arch}.ssm.group_count ({n_k}), and "
                             f"{arch}.ssm.inner_size ({inner}) of it")
    config = {"linear_num_value_heads": n_v, "linear_num_key_heads": n_k,
              "linear_key_head_dim": count("ssm.state_size"),
              "linear_value_head_dim": inner // n_v,
              "linear_conv_kernel_dim": count("ssm.conv_kernel"),
              "full_attention_interval": _qwen35_interval(arch, g, count, n_layers),
              "attention_bias": False, "partial_rotary_factor": rotary}
    if arch in QWEN35:  # (its MRoPE sections left out: on text they turn by one position, and
        # transformers warns of them beside a "default" RoPE)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                                     "partial_rotary_factor": rotary}
    if arch == "qwen3next":  # llama.cpp requires experts in every layer
        config["mlp_only_layers"] = []
    if arch != "qwen35":  # every layer sparse beside a gated shared expert; llama.cpp
        # renormalises the top experts' softmax weights (hard-wired)
        n_experts, n_used = experts()
        shared = count("expert_shared_feed_forward_length", g("feed_forward_length"))
        config.update(num_experts=n_experts, num_experts_per_tok=n_used,
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      shared_expert_intermediate_size=shared, norm_topk_prob=True,
                      decoder_sparse_step=1, intermediate_size=count("feed_forward_length", shared))
    return config


def _sparse_moe_config(arch: str, count: Any, optional: Any, experts: Any, tensors: dict,
                       config: dict) -> dict:
    """mlx-lm's settings of the sparse MoE GGUFs llama.cpp routes by a softmax over every
    expert's logit, in every layer: Mixtral (a ``llama`` GGUF with experts, ``mixtral``) and
    Granite MoE (``granitemoe``), the top experts' weights renormalised (as llama.cpp's graphs
    hard-wire it; mlx-lm's models take the softmax of the top logits: the same weights);
    Qwen1.5/2-MoE (``qwen2_moe``) and OLMoE (``olmoe``), not renormalised (llama.cpp's graphs;
    mlx-lm's olmoe told so). The experts ``feed_forward_length`` wide (qwen2moe's
    ``expert_feed_forward_length``, else that over the experts used), qwen2moe's shared expert
    ``expert_shared_feed_forward_length`` (else ``feed_forward_length``) beside them, scaled by
    the sigmoid of its gate. Granite MoE Shared's shared expert is refused (mlx-lm's
    granitemoe has none), and so are Mixtral's RoPE scaling (mlx-lm's mixtral has none) and
    heads other than hidden / heads wide where mlx-lm's model takes them so."""
    n_experts, n_used = experts()
    model_type = "mixtral" if arch == "llama" else config["model_type"]
    _check_heads_of_hidden(arch, model_type, config["num_attention_heads"], config["head_dim"],
                           config["hidden_size"])
    width = config["intermediate_size"]
    if arch == "llama":
        if "rope_freqs.weight" in tensors:
            raise UserInputError("GGUF llama with experts (Mixtral) and RoPE scaling (rope_freqs) "
                                 "is not supported (mlx-lm's mixtral has none)")
        return {"model_type": model_type, "architectures": ["MixtralForCausalLM"],
                "num_local_experts": n_experts, "num_experts_per_tok": n_used}
    if arch == "granitemoe":
        if optional("expert_shared_feed_forward_length"):
            raise UserInputError("GGUF granitemoe with a shared expert (Granite MoE Shared) is "
                                 "not supported (mlx-lm's granitemoe has none)")
        return {"num_local_experts": n_experts, "num_experts_per_tok": n_used}
    if arch == "olmoe":
        return {"num_experts": n_experts, "num_experts_per_tok": n_used, "norm_topk_prob": False}
    without = [i for i in range(config["num_hidden_layers"])
               if f"blk.{i}.ffn_gate_inp_shexp.weight" not in tensors]
    if without:  # llama.cpp refuses such a file too
        raise UserInputError(f"GGUF qwen2moe without its shared expert's gate "
                             f"(blk.{without[0]}.ffn_gate_inp_shexp.weight) is not supported "
                             "(mlx-lm's qwen2_moe scales the shared expert by its sigmoid)")
    return {"num_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length", width // n_used),
            "shared_expert_intermediate_size": count("expert_shared_feed_forward_length", width)}


def _qwen35_interval(arch: str, g: Any, count: Any, n_layers: int) -> int:
    """The period n of Qwen3.5's full-attention layers (layer i attends fully when
    (i + 1) % n == 0), from llama.cpp's flag per layer (``attention.recurrent_layers``, which
    it prefers) or its interval (4 when the GGUF gives neither)."""
    flags = g("attention.recurrent_layers")
    if flags is None:
        interval = count("full_attention_interval", QWEN35_FULL_ATTENTION_INTERVAL)
        if interval > n_layers:
            raise UserInputError(f"GGUF {arch} without a full-attention layer (interval "
                                 f"{interval}, {n_layers} layers) is not supported")
        return interval
    key = f"GGUF metadata {arch}.attention.recurrent_layers"
    if not isinstance(flags, list) or len(flags) < n_layers:
        raise UserInputError(f"{key} must be a flag per layer, got {shown(flags, 40)}")
    linear = [bool(x) for x in flags[:n_layers]]
    interval = linear.index(False) + 1 if False in linear else None
    if interval is None or any(x != ((i + 1) % interval != 0) for i, x in enumerate(linear)):
        raise UserInputError(f"{key} are not mlx-lm's qwen3_5 pattern (every n-th layer "
                             f"full attention, the others linear): {shown(flags, 40)}")
    return interval


def _glm4moe_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                    tensors: dict, n_layers: int, rotary: float) -> dict:
    """mlx-lm's glm4_moe settings of a GLM-4.5/4.6/4.7 GGUF, read as llama.cpp reads it: its
    experts as :func:`_routed_experts` reads them, sigmoid scores (its only gating function);
    q/k/v biases and q/k norms where the tensors have them; RoPE over ``rope.dimension_count``
    of each head's dims, NeoX-style (its MRoPE sections, GLM-4.5V's, turn by one position on
    text: the same RoPE)."""
    _check_gating("glm4moe", "glm4_moe", g("expert_gating_func", _NO_GATING),
                  (_NO_GATING, _SIGMOID_GATING))
    return {**_routed_experts("glm4moe", "glm4_moe", g, count, positive, optional, experts,
                              tensors, n_layers),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
            "partial_rotary_factor": rotary, "rope_scaling": None}


def _llama4_config(g: Any, count: Any, experts: Any, n_layers: int, config: dict) -> dict:
    """mlx-lm's llama4 settings of a Llama 4 GGUF, read as llama.cpp reads it: chunked attention
    (llama.cpp's chunk, whatever the window key but 0) in all layers but every 4th by
    llama.cpp's pattern, which must be mlx-lm's hard-wired one; RoPE (traditional, q/k as they
    are) and weightless q/k norms (not in Maverick) there, the attention temperature (llama.cpp's
    constants) in the others; every ``interleave_moe_layer_step``-th layer an MoE of one expert
    a token (mlx-lm's), weighed by its sigmoid before it, beside a shared expert as wide; the
    others dense MLPs ``feed_forward_length`` wide; a head of its own (glm4_tensors makes one
    of a tied GGUF's embedding)."""
    if g("attention.sliding_window") == 0:  # MobileLLM-R1: llama.cpp then turns RoPE off in
        # the last layer only
        raise UserInputError("GGUF llama4 without chunked attention (sliding window 0) is not "
                             "supported (mlx-lm's llama4 chunks 3 of every 4 layers)")
    local = _local_layers(g("attention.sliding_window_pattern", 4), n_layers, "llama4")
    if local != [(i + 1) % 4 != 0 for i in range(n_layers)]:
        raise UserInputError("GGUF llama4 with a chunked-attention pattern other than 3 chunked "
                             "layers, then a global one, is not supported (mlx-lm's llama4)")
    if g("rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
        raise UserInputError("GGUF llama4 with another RoPE base in its chunked layers is not "
                             "supported")
    n_experts, n_used = experts()
    if n_used != 1:
        raise UserInputError(f"GGUF llama4 with {n_used} experts a token is not supported "
                             "(mlx-lm's llama4 routes each token to one)")
    return {"attention_chunk_size": LLAMA4_CHUNK, **LLAMA4_TEMPERATURE,
            "attn_temperature_tuning": True, "attention_bias": False,
            "interleave_moe_layer_step": count("interleave_moe_layer_step"),
            "num_local_experts": n_experts, "num_experts_per_tok": n_used,
            "intermediate_size": count("expert_feed_forward_length"),
            "intermediate_size_mlp": config["intermediate_size"],
            "use_qk_norm": n_experts != LLAMA4_MAVERICK_EXPERTS, "tie_word_embeddings": False,
            "rope_scaling": None}  # (Llama 3's from rope_freqs, where the GGUF has them)


def _leading_dense(arch: str, optional: Any, n_layers: int) -> int:
    """The layers before the first sparse one (``leading_dense_block_count``, 0 without)."""
    dense = optional("leading_dense_block_count")
    if dense > n_layers:
        raise UserInputError(f"GGUF metadata {arch}.leading_dense_block_count ({dense}) exceeds "
                             f"its {n_layers} layers")
    return dense


def _routed_experts(arch: str, model_type: str, g: Any, count: Any, positive: Any,
                    optional: Any, experts: Any, tensors: dict, n_layers: int,
                    tied: bool = False) -> dict:
    """mlx-lm's settings of DeepSeek's MoE layout (GLM-4.5's and deepseek2's), read as
    llama.cpp reads it: the first ``leading_dense_block_count`` layers dense, the others sparse
    beside ``expert_shared_count`` shared experts (at least one); sigmoid scores biased by
    ``exp_probs_b`` to choose the experts (within the best ``expert_group_used_count`` of
    ``expert_group_count`` groups) but not to weigh them, the chosen weights renormalised where
    ``expert_weights_norm`` says so and scaled by ``expert_weights_scale`` (0 or none: 1).
    mlx-lm's model (``model_type``) has a head of its own: a tied one is refused, unless
    ``tied`` (a model that ties it where the GGUF has none)."""
    n_experts, n_used = experts()
    dense = _leading_dense(arch, optional, n_layers)
    groups, used_groups = optional("expert_group_count"), optional("expert_group_used_count")
    if groups > 1 and (n_experts % groups or groups >= n_experts
                       or not 0 < used_groups < groups):  # llama.cpp asserts as much
        raise UserInputError(f"GGUF metadata {arch}.expert_group_count ({groups}) must divide "
                             f"the {n_experts} experts into groups, of which "
                             f"expert_group_used_count ({used_groups}) are fewer")
    if groups > 1:  # mlx-lm scores the other groups' experts 0 where llama.cpp takes -inf:
        # the same experts while every score (a sigmoid, plus the bias) is positive
        for name in sorted(n for n in tensors if n.endswith(".exp_probs_b.bias")):
            if dequantized(tensors[name]).min() < 0:
                raise UserInputError(
                    f"GGUF {arch} with expert groups and a negative correction bias ({name}) "
                    f"is not supported: mlx-lm's {model_type} would pick experts of the groups "
                    "llama.cpp leaves out")
    norm = g("expert_weights_norm", False)
    if not isinstance(norm, (bool, np.bool_)):
        raise UserInputError(f"GGUF metadata {arch}.expert_weights_norm must be true or false, "
                             f"got {shown(norm, 40)}")
    if norm and n_used == 1:  # mlx-lm's models renormalise two or more only
        raise UserInputError(f"GGUF {arch} renormalising the weight of one expert a token is "
                             "not supported")
    if "output.weight" not in tensors and not tied:  # llama.cpp reads the embedding then
        raise UserInputError(f"GGUF {arch} without output.weight (tied embeddings) is not "
                             f"supported (mlx-lm's {model_type} has a head of its own)")
    # llama.cpp requires the count; none (0) would be n_shared_experts None to mlx-lm's
    # glm4_moe, which transformers' config of it refuses (loading the tokenizer reads it)
    shared = count("expert_shared_count")
    return {"n_routed_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length"),
            "n_shared_experts": shared, "first_k_dense_replace": dense,
            "n_group": groups if groups > 1 else 1,
            "topk_group": used_groups if groups > 1 else 1,
            "routed_scaling_factor": (positive("expert_weights_scale")
                                      if g("expert_weights_scale", 0) != 0 else 1.0),
            "norm_topk_prob": bool(norm), "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _minimax_m3_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                       tensors: dict, n_layers: int, rope_dims: int) -> dict:
    """mlx-lm's settings of a MiniMax-M3 GGUF's text model: DeepSeek's MoE layout
    (:func:`_routed_experts`: leading dense layers, then sigmoid-routed experts with their
    selection bias beside one shared MLP ``expert_shared_count`` experts wide), renormalised
    in one group as mlx-lm's minimax_m3_vl always routes; its norms as stored (llama.cpp's
    converter bakes Gemma's 1 + w in: mlx-lm's plain RMSNorm then); per-head q/k norms, RoPE
    over ``rope.dimension_count``; the indexer (``attention.indexer.*``) in the sparse layers,
    which llama.cpp's graph makes the MoE ones. The SwiGLU-OAI's alpha and limit are
    llama.cpp's hard-wired 1.702 and 7, mlx-lm's defaults."""
    arch = "minimax-m3"
    moe = _routed_experts(arch, "minimax_m3_vl", g, count, positive, optional, experts, tensors,
                          n_layers)
    if moe["n_group"] != 1 or not moe["norm_topk_prob"]:
        raise UserInputError("GGUF minimax-m3 with expert groups or unrenormalised expert "
                             "weights is not supported (mlx-lm's minimax_m3_vl renormalises "
                             "the experts it picks among all)")
    sparse = [int(i >= moe["first_k_dense_replace"]) for i in range(n_layers)]
    index = {key: count(f"attention.indexer.{name}") for key, name in (
        ("sparse_num_index_heads", "head_count"), ("sparse_index_dim", "key_length"),
        ("sparse_block_size", "block_size"), ("sparse_topk_blocks", "top_k"))}
    return {"num_local_experts": moe["n_routed_experts"],
            "num_experts_per_tok": moe["num_experts_per_tok"],
            "intermediate_size": moe["moe_intermediate_size"],
            "shared_intermediate_size": moe["moe_intermediate_size"] * moe["n_shared_experts"],
            "dense_intermediate_size": count("feed_forward_length"),
            "routed_scaling_factor": moe["routed_scaling_factor"], "rotary_dim": rope_dims,
            "use_qk_norm": True, "use_gemma_norm": False, "moe_layer_freq": sparse,
            "sparse_attention_config": {
                **index, "sparse_local_block": optional("attention.indexer.local_blocks"),
                "sparse_attention_freq": sparse}}


def _exaone_moe_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                       tensors: dict, n_layers: int) -> dict:
    """mlx-lm's settings of a K-EXAONE GGUF: llama.cpp's window (required) in its pattern,
    RoPE in the sliding layers only, which mlx-lm's exaone_moe takes only beside a global layer
    (without a local one it turns every layer, llama.cpp's graph none: refused); DeepSeek's MoE
    layout (:func:`_routed_experts`) under mlx-lm's exaone_moe names."""
    arch = "exaone-moe"
    pattern = _sliding_pattern(g("attention.sliding_window_pattern", MELLUM_SLIDING_PATTERN),
                               n_layers, arch)
    if pattern is None:
        raise UserInputError("GGUF exaone-moe without a sliding-window layer is not supported "
                             "(llama.cpp's graph then turns no layer by RoPE, mlx-lm's "
                             "exaone_moe every layer)")
    moe = _routed_experts(arch, "exaone_moe", g, count, positive, optional, experts, tensors,
                          n_layers)
    dense, routed, shared = (moe.pop(k) for k in ("first_k_dense_replace", "n_routed_experts",
                                                  "n_shared_experts"))
    return {**moe, "num_experts": routed, "num_shared_experts": shared,
            "is_moe_layer": [i >= dense for i in range(n_layers)],
            "sliding_window": count("attention.sliding_window"),
            "layer_types": ["sliding_attention" if c == "L" else "full_attention"
                            for c in (pattern * n_layers)[:n_layers]]}


def _mimo2_config(g: Any, count: Any, real: Any, positive: Any, experts: Any, tensors: dict,
                  config: dict, rotary: float | None) -> dict:
    """mlx-lm's settings of a MiMo-V2-Flash GGUF, read as llama.cpp reads it: the sliding-window
    layers by a flag each, their window and RoPE base (``rope.freq_base_swa``, else the global
    one); key/value heads by layer, one count for each kind of layer as mlx-lm's mimo_v2_flash
    takes (its converter writes no other); sinks in every layer of a kind or in none; values
    ``value_length`` wide, times ``value_scale`` (llama.cpp's 0 or 1: unscaled); experts where a
    layer has a router, sigmoid-routed with their selection bias, renormalised and unscaled, no
    shared ones (llama.cpp's graph hard-wires all of it); the NextN blocks dropped (the
    metadata's arrays hold their values too)."""
    arch, n_layers = "mimo2", config["num_hidden_layers"]
    local, total = _kinds_of_layers(arch, g, count, config)
    kv = _per_layer(arch, g, count, total, "attention.head_count_kv",
                    config["num_attention_heads"])[:n_layers]
    sinks = [f"blk.{i}.attn_sinks.weight" in tensors for i in range(n_layers)]
    kinds = {}
    for kind, name in ((True, "sliding-window"), (False, "global")):
        heads, sinks_of = ({x[i] for i in range(n_layers) if local[i] == kind} for x in (kv, sinks))
        if len(heads) > 1 or len(sinks_of) > 1:
            raise UserInputError(f"GGUF mimo2 whose {name} layers differ in key/value heads or "
                                 "attention sinks is not supported (mlx-lm's mimo_v2_flash takes "
                                 "one setting for each kind of layer)")
        kinds[kind] = heads.pop(), sinks_of.pop()
    if "output.weight" not in tensors:  # llama.cpp requires it too
        raise UserInputError("GGUF mimo2 without output.weight (tied embeddings) is not "
                             "supported (mlx-lm's mimo_v2_flash has a head of its own)")
    n_experts, n_used = experts()
    head_dim, values = config["head_dim"], count("attention.value_length", config["head_dim"])
    value_scale = real("attention.value_scale", 1.0)
    return {"hybrid_layer_pattern": [int(x) for x in local],
            "moe_layer_freq": [int(f"blk.{i}.ffn_gate_inp.weight" in tensors)
                               for i in range(n_layers)],
            "sliding_window_size": count("attention.sliding_window"),
            "swa_rope_theta": positive("rope.freq_base_swa", config["rope_theta"]),
            "num_key_value_heads": kinds[False][0], "swa_num_key_value_heads": kinds[True][0],
            "add_full_attention_sink_bias": kinds[False][1],
            "add_swa_attention_sink_bias": kinds[True][1],
            "swa_num_attention_heads": config["num_attention_heads"], "swa_head_dim": head_dim,
            "v_head_dim": values, "swa_v_head_dim": values, "partial_rotary_factor": rotary,
            "attention_value_scale": value_scale if value_scale not in (0, 1) else None,
            "layernorm_epsilon": config["rms_norm_eps"], "tie_word_embeddings": False,
            "n_routed_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length"),
            "n_shared_experts": None, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1}


def _kinds_of_layers(arch: str, g: Any, count: Any, config: dict) -> tuple[list[bool], int]:
    """Which of a GGUF's layers slide (a flag each, required), and how many blocks its
    metadata's arrays cover (the NextN blocks' too); refused unless both kinds are there."""
    total = count("block_count")
    if g("attention.sliding_window_pattern") is None:  # llama.cpp requires it
        raise UserInputError(f"GGUF metadata lacks {arch}.attention.sliding_window_pattern")
    local = _local_layers(g("attention.sliding_window_pattern"), total,
                          arch)[:config["num_hidden_layers"]]
    if all(local) or not any(local):
        raise UserInputError(f"GGUF {arch} without both sliding-window and global layers is not "
                             f"supported (mlx-lm's {config['model_type']} needs one of each)")
    return local, total


def _step35_config(g: Any, count: Any, real: Any, positive: Any, experts: Any, tensors: dict,
                   config: dict, rope_dims: int) -> dict:
    """mlx-lm's settings of a Step-3.5 GGUF, read as llama.cpp reads it: sliding-window layers by
    a flag each, with their own heads, key/value heads (one count for each kind of layer, as
    mlx-lm's step3p5 takes), RoPE base (``rope.freq_base_swa``) and rotated dims
    (``rope.dimension_count_swa``, else all of ``rope.dimension_count``; the global layers half
    of it, as llama.cpp hard-wires, with Llama 3's scaling where the GGUF holds ``rope_freqs``,
    whose first entries are theirs); per-head q/k norms (stored as mlx-lm holds them, 1 + w)
    and output gates, each in every layer or none; a dense MLP where a layer has no router,
    else experts (sigmoid unless the GGUF names another gating function, their selection bias,
    the weights renormalised and scaled where the GGUF says) beside a shared expert; SwiGLU
    clamped per layer (``swiglu_clamp_exp``, ``swiglu_clamp_shexp``: 0 none)."""
    arch, n_layers, head_dim = "step35", config["num_hidden_layers"], config["head_dim"]
    local, total = _kinds_of_layers(arch, g, count, config)
    heads = _per_layer(arch, g, count, total, "attention.head_count")[:n_layers]
    kv = _per_layer(arch, g, count, total, "attention.head_count_kv")[:n_layers]
    kinds = {}
    for kind in (True, False):
        setting = {(heads[i], kv[i]) for i in range(n_layers) if local[i] == kind}
        if len(setting) > 1:
            raise UserInputError(f"GGUF step35 whose {'sliding-window' if kind else 'global'} "
                                 "layers differ in heads or key/value heads is not supported "
                                 "(mlx-lm's step3p5 takes one setting for each kind of layer)")
        kinds[kind] = setting.pop()
    for name, what in (("attn_q_norm", "q/k norms"), ("attn_k_norm", "q/k norms"),
                       ("attn_gate", "attention gates")):
        held = {f"blk.{i}.{name}.weight" in tensors for i in range(n_layers)}
        if held != {True} and (name != "attn_gate" or len(held) > 1):
            raise UserInputError(f"GGUF step35 with {what} in some layers only, or none, is not "
                                 "supported (mlx-lm's step3p5 has them in every layer, gates in "
                                 "every layer or none)")
    _check_gating("step35", "step3p5", g("expert_gating_func", _NO_GATING),
                  (_NO_GATING, _SIGMOID_GATING))
    if "output.weight" not in tensors:  # llama.cpp requires it too
        raise UserInputError("GGUF step35 without output.weight (tied embeddings) is not "
                             "supported (mlx-lm's step3p5 has a head of its own)")
    rotated = {True: count("rope.dimension_count_swa", rope_dims), False: rope_dims // 2}
    factors = {k: _rotary_factor(rotated[k], head_dim) for k in rotated}
    if None in factors.values():
        raise UserInputError(f"GGUF step35 with RoPE over {rotated[True]} and {rotated[False]} of "
                             f"each head's {head_dim} dims is not supported")
    bases = {True: positive("rope.freq_base_swa", config["rope_theta"]),
             False: config["rope_theta"]}
    # llama.cpp turns the global layers' RoPE by rope_freqs' first entries (Llama 3's scaling),
    # mlx-lm's step3p5 by its Llama 3 scaling in yarn_only_types
    scaling = None if "rope_freqs.weight" not in tensors else _llama3_rope_scaling(
        _rope_factors("rope_freqs.weight", tensors, max(rotated.values()))[:rotated[False] // 2],
        bases[False], rotated[False])
    n_experts, n_used = experts()
    norm = g("expert_weights_norm", False)
    clamps = {}
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):  # a limit per layer, or one for all
        value = g(key, 0.0)
        values = (value if isinstance(value, list) else [value] * total)[:n_layers]
        if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number))
               or not np.isfinite(v) for v in values):
            raise UserInputError(f"GGUF metadata step35.{key} must be finite numbers, got "
                                 f"{shown(value, 40)}")
        clamps[key] = [float(v) for v in values]
    return {"layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "sliding_window": count("attention.sliding_window"),
            "num_attention_heads": kinds[False][0], "num_attention_groups": kinds[False][1],
            "attention_other_setting": {"num_attention_heads": kinds[True][0],
                                        "num_attention_groups": kinds[True][1]},
            "rope_theta": [bases[x] for x in local], "rope_scaling": scaling,
            "yarn_only_types": ["full_attention"],
            "partial_rotary_factors": [factors[x] for x in local],
            "use_head_wise_attn_gate": "blk.0.attn_gate.weight" in tensors,
            "moe_layers_enum": ",".join(str(i) for i in range(n_layers)
                                        if f"blk.{i}.ffn_gate_inp.weight" in tensors),
            "moe_num_experts": n_experts, "moe_top_k": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length"),
            "share_expert_dim": count("expert_shared_feed_forward_length"),
            "moe_router_scaling_factor": real("expert_weights_scale", 0.0) or 1.0,
            "norm_expert_weight": bool(norm), "swiglu_limits": clamps["swiglu_clamp_exp"],
            "swiglu_limits_shared": clamps["swiglu_clamp_shexp"], "tie_word_embeddings": False}
def _bailing_config(arch: str, g: Any, count: Any, positive: Any, optional: Any,
                    experts: Any, tensors: dict, n_layers: int, rope_dims: int) -> dict:
    """mlx-lm's bailing_moe settings of a Ling/Ring GGUF: DeepSeek's MoE reading
    (:func:`_routed_experts`), a shared expert's width of its own where the GGUF gives one;
    bailingmoe (Ling 1) softmax-routed (llama.cpp's graph reads no selection bias), bailingmoe2
    (Ling/Ring 2.0) sigmoid-routed with its optional selection bias, q/k norms, RoPE over
    ``rope_dims`` of each head; no biases (llama.cpp reads none but Ling 1's q/k/v ones, which
    its checkpoints lack: refused by internlm2_tensors)."""
    v2 = arch == "bailingmoe2"
    moe = _routed_experts(arch, "bailing_moe", g, count, positive, optional, experts, tensors,
                          n_layers)
    return {"num_experts": moe["n_routed_experts"], "num_shared_experts": moe["n_shared_experts"],
            **{k: moe[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "n_group",
                                   "topk_group", "routed_scaling_factor", "norm_topk_prob",
                                   "first_k_dense_replace")},
            "score_function": "sigmoid" if v2 else "softmax",
            "moe_router_enable_expert_bias": v2 and any(
                name.endswith(".exp_probs_b.bias") for name in tensors),
            "moe_shared_expert_intermediate_size":
                optional("expert_shared_feed_forward_length") or None,
            "use_qk_norm": v2, "use_bias": False, "use_qkv_bias": False, "norm_head": False,
            "rotary_dim": rope_dims}


def _afmoe_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                  tensors: dict, n_layers: int) -> dict:
    """mlx-lm's settings of an AFM GGUF: llama.cpp's graph scales the embeddings (mup) and turns
    RoPE in every layer but each :data:`AFMOE_NO_ROPE_PERIOD`-th, mlx-lm's afmoe in its sliding
    layers: the window's pattern (llama.cpp's, period 4 unless given) must be that one;
    DeepSeek's MoE layout (:func:`_routed_experts`) under mlx-lm's afmoe names, sigmoid-routed
    (llama.cpp's default)."""
    arch = "afmoe"
    window = optional("attention.sliding_window")
    pattern = _sliding_pattern(g("attention.sliding_window_pattern", AFMOE_NO_ROPE_PERIOD),
                               n_layers, arch) if window else None
    local = [c == "L" for c in ((pattern or "G") * n_layers)[:n_layers]]
    if local != [(i + 1) % AFMOE_NO_ROPE_PERIOD != 0 for i in range(n_layers)]:
        raise UserInputError(f"GGUF afmoe whose sliding-window layers are not every layer but "
                             f"each {AFMOE_NO_ROPE_PERIOD}th is not supported (llama.cpp turns "
                             "RoPE in those, mlx-lm's afmoe in its sliding layers)")
    _check_gating(arch, "afmoe", g("expert_gating_func", _SIGMOID_GATING),
                  (_NO_GATING, _SIGMOID_GATING))
    moe = _routed_experts(arch, "afmoe", g, count, positive, optional, experts, tensors,
                          n_layers, tied=True)
    return {"num_experts": moe["n_routed_experts"],
            "num_experts_per_tok": moe["num_experts_per_tok"],
            "moe_intermediate_size": moe["moe_intermediate_size"],
            "num_shared_experts": moe["n_shared_experts"],
            "num_dense_layers": moe["first_k_dense_replace"], "route_norm": moe["norm_topk_prob"],
            "route_scale": moe["routed_scaling_factor"], "score_func": "sigmoid",
            "n_group": moe["n_group"], "topk_group": moe["topk_group"], "sliding_window": window,
            "mup_enabled": True, "layer_types": ["sliding_attention" if x else "full_attention"
                                                 for x in local]}


def _deepseek2_config(meta: dict, g: Any, count: Any, real: Any, positive: Any, optional: Any,
                      experts: Any, tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's settings of a deepseek2 GGUF, read as llama.cpp reads it, and which of its
    models computes what llama.cpp does: softmax routing (DeepSeek-V2/V2-Lite: llama.cpp's
    default but for GLM-4.7-Flash, which it recognises by its layers and vocabulary) is
    ``deepseek_v2``; sigmoid routing with a correction bias (DeepSeek-V3/R1, Kimi, Moonlight)
    ``deepseek_v3``, or ``glm4_moe_lite`` for GLM's GGUF (its "glm4" pre-tokenizer) and where
    the RMS epsilon is not the 1e-6 deepseek_v3 hard-wires for its latent norms (glm4_moe_lite
    takes the config's; the same model otherwise). Without experts, every layer dense
    (Youtu-LLM, as llama.cpp's converter writes it), ``youtu_llm`` (the config's epsilon, a tied
    head read as the embedding, no RoPE scaling).

    Multi-head latent attention: q through a rank ``attention.q_lora_rank`` (where the tensors
    have ``attn_q_a``; V2-Lite projects q directly), keys and values through
    ``attention.kv_lora_rank``; each q/k head ``key_length_mla`` wide (``key_length`` in a file
    without llama.cpp's MLA keys), its last ``rope.dimension_count`` dims rotated (traditional
    RoPE, in llama.cpp and mlx-lm alike), values ``value_length_mla`` (``value_length``) wide."""
    n_layers = config["num_hidden_layers"]
    latent = _latent_attention("deepseek2", count, tensors, config, rope_dims)
    value_length = ("attention.value_length_mla" if g("attention.value_length_mla") is not None
                    else "attention.value_length")
    if real("attention.temperature_scale", 0.0):  # Mistral Large 3's, in llama.cpp's deepseek2
        raise UserInputError("GGUF deepseek2 with an attention temperature "
                             "(attention.temperature_scale) is not supported")
    if not optional("expert_count"):  # llama.cpp needs experts in every layer past the dense
        dense = optional("leading_dense_block_count")
        if dense != n_layers:
            raise UserInputError(f"GGUF deepseek2 without experts has {n_layers - dense} sparse "
                                 f"layers (leading_dense_block_count {dense} of {n_layers})")
        if g("rope.scaling.type") not in (None, "none"):  # DeepSeek's YaRN is not youtu_llm's
            raise UserInputError(f"GGUF deepseek2 without experts (Youtu-LLM) with RoPE scaling "
                                 f"({shown(g('rope.scaling.type'), 20)}) is not supported")
        return {"model_type": "youtu_llm", "architectures": ["YoutuForCausalLM"],
                "num_key_value_heads": config["num_attention_heads"], **latent,
                "v_head_dim": count(value_length), "attention_bias": False, "mlp_bias": False,
                "rope_traditional": True, "rope_scaling": None}
    gating = g("expert_gating_func", _NO_GATING)
    if gating == _NO_GATING:  # llama.cpp's loader: older DeepSeek-V2/V2.5 files write none
        vocab = g("vocab_size", len(meta.get("tokenizer.ggml.tokens") or []))
        layers = {n_layers, g("block_count")}
        glm = vocab == GLM47_FLASH_VOCAB and bool(layers & set(GLM47_FLASH_LAYERS))
        gating = _SIGMOID_GATING if glm else _SOFTMAX_GATING
    _check_gating("deepseek2", "deepseek_v2/deepseek_v3", gating,
                  (_SOFTMAX_GATING, _SIGMOID_GATING))
    latent_eps = np.float32(config["rms_norm_eps"]) == DEEPSEEK_LATENT_EPS
    if gating == _SOFTMAX_GATING:
        model_type = "deepseek_v2"
    elif meta.get("tokenizer.ggml.pre") == "glm4" or not latent_eps:
        model_type = "glm4_moe_lite"
    else:
        model_type = "deepseek_v3"
    moe = _routed_experts("deepseek2", model_type, g, count, positive, optional, experts,
                          tensors, n_layers)
    if model_type == "deepseek_v2":  # greedy softmax top-k, as DeepSeek-V2-Lite routes
        if moe["n_group"] > 1:  # V2's group_limited_greedy, which llama.cpp computes otherwise
            raise UserInputError("GGUF deepseek2 with softmax routing within expert groups is "
                                 "not supported (llama.cpp ranks a group by its two best "
                                 "experts, mlx-lm's deepseek_v2 by its best)")
        if moe["norm_topk_prob"]:
            raise UserInputError("GGUF deepseek2 with softmax routing renormalising its experts' "
                                 "weights (expert_weights_norm) is not supported (mlx-lm's "
                                 "deepseek_v2 never does)")
        moe.update(scoring_func="softmax", topk_method="greedy")
    out = {"model_type": model_type,
           "architectures": [{"deepseek_v2": "DeepseekV2ForCausalLM",
                              "deepseek_v3": "DeepseekV3ForCausalLM",
                              "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}[model_type]],
           # the checkpoint's (llama.cpp writes MLA's one latent head)
           "num_key_value_heads": config["num_attention_heads"], **latent,
           "v_head_dim": count(value_length), "attention_bias": False,
           # deepseek_v2's RoPE reads a factor always (1: none)
           "rope_scaling": {"rope_type": "default", "factor": 1.0}
           if model_type == "deepseek_v2" else None,
           **moe}
    return out


def _check_gating(arch: str, model_type: str, gating: Any, routes: tuple[int, ...]) -> None:
    """Refuse in one line a GGUF whose expert gating function (llama.cpp's number, ``None``
    where it gives none) is not in ``routes``, those mlx-lm's ``model_type`` routes by (with
    :data:`_NO_GATING` where llama.cpp's default for ``arch`` is one of them)."""
    if gating not in routes:
        names = " or ".join(f"{_GATING_NAMES[r]} ({r})" for r in routes if r != _NO_GATING)
        raise UserInputError(f"GGUF {arch} with expert gating function {shown(gating, 20)} is "
                             f"not supported (mlx-lm's {model_type} routes by {names})")


def _mistral4_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                     tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's mistral4 settings of a Mistral Small 4 GGUF, read as llama.cpp's deepseek2 graph
    (its mistral4's) reads it: latent attention (:func:`_latent_attention`) and DeepSeek's MoE
    layout (:func:`_routed_experts`) routed by softmax (the only gating of mlx-lm's mistral4),
    the latent norms' RMS epsilon the 1e-6 mlx-lm's mistral4 hard-wires (llama.cpp's: the
    GGUF's)."""
    if not optional("expert_count"):
        raise UserInputError("GGUF mistral4 without experts is not supported")
    # (none: llama.cpp's softmax)
    _check_gating("mistral4", "mistral4", g("expert_gating_func", _NO_GATING),
                  (_NO_GATING, _SOFTMAX_GATING))
    latent = _latent_attention("mistral4", count, tensors, config, rope_dims)
    moe = _routed_experts("mistral4", "mistral4", g, count, positive, optional, experts,
                          tensors, config["num_hidden_layers"])
    value_length = ("attention.value_length_mla" if g("attention.value_length_mla") is not None
                    else "attention.value_length")
    return {"num_key_value_heads": config["num_attention_heads"], **latent,
            "v_head_dim": count(value_length), "attention_bias": False,
            **{k: v for k, v in moe.items() if k not in ("scoring_func", "topk_method")}}


def _dsa_config(arch: str, g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's deepseek_v32 (``deepseek32``) or glm_moe_dsa (``glm-dsa``) settings of a GGUF,
    read as llama.cpp reads it: deepseek2's latent attention (:func:`_latent_attention`) and
    DeepSeek's MoE layout (:func:`_routed_experts`) routed by sigmoid (the only gating of
    mlx-lm's model; GLM-5's by default), the latent norms' RMS epsilon the 1e-6 mlx-lm
    hard-wires (llama.cpp's: the GGUF's), and a lightning indexer in every layer
    (``attention.indexer.head_count``, ``key_length``, ``top_k``) whose RoPE turns the first
    ``rope.dimension_count`` dims of its heads, NeoX-style in DeepSeek-V3.2, traditional in
    GLM-5 (as in llama.cpp and mlx-lm). GLM-5.2's layers reusing another's top-k
    (``attention.indexer.types``, or its default pattern from a context of 2**20 on) are
    refused: mlx-lm's model has an indexer in each."""
    _check_gating(arch, _MODEL_TYPES[arch],
                  g("expert_gating_func", _NO_GATING if arch == "glm-dsa" else None),
                  (_NO_GATING, _SIGMOID_GATING))
    types = g("attention.indexer.types")
    if arch == "glm-dsa" and (not all(types) if isinstance(types, list) else
                              types is None and config["max_position_embeddings"] >= 2 ** 20):
        raise UserInputError("GGUF glm-dsa with layers reusing another layer's indexer "
                             "(GLM-5.2's attention.indexer.types) is not supported (mlx-lm's "
                             "glm_moe_dsa has an indexer in every layer)")
    index_dims = count("attention.indexer.key_length")
    if rope_dims > index_dims:  # llama.cpp asserts as much
        raise UserInputError(f"GGUF {arch} with RoPE over {rope_dims} dims of indexer heads "
                             f"{index_dims} wide is not supported")
    latent = _latent_attention(arch, count, tensors, config, rope_dims)
    moe = _routed_experts(arch, _MODEL_TYPES[arch], g, count, positive, optional, experts,
                          tensors, config["num_hidden_layers"])
    value_length = ("attention.value_length_mla" if g("attention.value_length_mla") is not None
                    else "attention.value_length")
    return {"num_key_value_heads": config["num_attention_heads"], **latent,
            "v_head_dim": count(value_length), "attention_bias": False, "moe_layer_freq": 1,
            "index_n_heads": count("attention.indexer.head_count"), "index_head_dim": index_dims,
            "index_topk": count("attention.indexer.top_k"),
            "indexer_rope_interleave": arch == "glm-dsa", **moe}


def _mistral4_rope(g: Any, count: Any, real: Any, config: dict) -> dict:
    """mlx-lm's mistral4 ``rope_parameters``: the RoPE (YaRN's, as deepseek2's) and Llama 4's
    attention temperature (``attention.temperature_scale`` over ``temperature_length``, as
    llama.cpp's deepseek2 loader reads it; none without it), whose floor scale is YaRN's
    original context in mlx-lm's mistral4 (another is refused)."""
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"],
            **(config.pop("rope_scaling", None) or {}), "llama_4_scaling_beta": 0.0}
    rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    beta = real("attention.temperature_scale", 0.0)
    if beta:
        floor = count("attention.temperature_length")
        if "factor" in rope and floor != rope["original_max_position_embeddings"]:
            raise UserInputError(f"GGUF mistral4 with an attention temperature over {floor} "
                                 "positions is not supported (mlx-lm's mistral4 takes YaRN's "
                                 f"original context, {rope['original_max_position_embeddings']})")
        rope.update(llama_4_scaling_beta=beta, original_max_position_embeddings=floor)
    return rope


def _latent_attention(arch: str, count: Any, tensors: dict, config: dict,
                      rope_dims: int) -> dict:
    """mlx-lm's settings of multi-head latent attention (:data:`MLA`): queries through a rank
    ``attention.q_lora_rank`` where the tensors have ``attn_q_a`` (DeepSeek-V2-Lite projects
    them directly; MiniCPM3 never, as llama.cpp and mlx-lm require the rank), keys and values
    through ``attention.kv_lora_rank``, the last ``rope.dimension_count`` dims of each q/k head
    rotated; the config's ``head_dim`` dropped (no key of these models)."""
    head_dim = config.pop("head_dim")
    nope = head_dim - rope_dims
    if nope < 1:  # llama.cpp asserts as much
        raise UserInputError(f"GGUF {arch} with RoPE over {rope_dims} of each head's "
                             f"{head_dim} dims is not supported (it needs dims without RoPE)")
    q_lora = arch == "minicpm3" or any(name.endswith(".attn_q_a.weight") for name in tensors)
    return {"q_lora_rank": count("attention.q_lora_rank") if q_lora else None,
            "kv_lora_rank": count("attention.kv_lora_rank"),
            "qk_rope_head_dim": rope_dims, "qk_nope_head_dim": nope}


def _kimi_linear_config(g: Any, count: Any, real: Any, optional: Any, experts: Any,
                        tensors: dict, config: dict, rope_dims: int,
                        arch: str = "kimi-linear") -> dict:
    """mlx-lm's kimi_linear settings of a GGUF, read as llama.cpp reads it: Kimi Delta
    Attention (``attention.head_count`` heads ``kda.head_dim`` wide, ``ssm.conv_kernel``) where
    a layer has no key/value heads, latent attention without RoPE in the others (queries in one
    step: low-rank ones refused), experts from ``leading_dense_block_count`` on, routed by the
    gating function (sigmoid or softmax; no groups), their top weights renormalised (one expert
    a token refused: llama.cpp's weight 1, mlx-lm's its score) and scaled; the KDA q/k norms'
    epsilon mlx-lm's 1e-6 (llama.cpp's: the GGUF's). (Kimi K3's ``arch``: its low-rank queries
    taken, :func:`_kimi_k3_config`.)"""
    if arch == "kimi-linear" and any(".attn_q_a." in name for name in tensors):
        raise UserInputError(f"GGUF {arch} with low-rank queries (attn_q_a) is not supported "
                             "(mlx-lm's kimi_linear projects its queries in one step)")
    kv = _hybrid_kv_heads(arch, g, count, config, "Kimi Delta Attention")
    gating = g("expert_gating_func")
    _check_gating(arch, "kimi_linear", gating, (_SOFTMAX_GATING, _SIGMOID_GATING))
    n_experts, n_used = experts()
    if n_used == 1:
        raise UserInputError(f"GGUF {arch} with one expert per token is not supported (llama.cpp "
                             f"renormalises its weight to 1, mlx-lm's {config['model_type']} "
                             "keeps its score)")
    head_dim = config["head_dim"]
    latent = _latent_attention(arch, count, tensors, config, rope_dims)
    return {**latent, "head_dim": head_dim, "mla_use_nope": True,
            "v_head_dim": count("attention.value_length_mla"),
            "linear_attn_config": {
                "kda_layers": [i + 1 for i, n in enumerate(kv) if not n],
                "full_attn_layers": [i + 1 for i, n in enumerate(kv) if n],
                "num_heads": config["num_attention_heads"], "head_dim": count("kda.head_dim"),
                "short_conv_kernel_size": count("ssm.conv_kernel")},
            "model_max_length": config["max_position_embeddings"],
            "num_experts": n_experts, "num_experts_per_token": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length"),
            "num_shared_experts": optional("expert_shared_count"),
            "first_k_dense_replace": _leading_dense(arch, optional, config["num_hidden_layers"]),
            "moe_layer_freq": 1, "moe_router_activation_func": _GATING_NAMES[gating],
            "moe_renormalize": True,
            "routed_scaling_factor": real("expert_weights_scale", 0.0) or 1.0,
            "use_grouped_topk": False, "num_expert_group": 1, "topk_group": 1}


def _kimi_k3_config(g: Any, count: Any, real: Any, positive: Any, optional: Any,
                    experts: Any, tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's kimi_k3 settings of a GGUF, read as llama.cpp reads it: Kimi Linear's
    (:func:`_kimi_linear_config`; low-rank queries where it has them, sigmoid routing only), the
    KDA layers' full-rank gate and ``kda.gate_lower_bound`` (none without), the latent
    attention's output gate where it has ``attn_gate``, experts on an ``expert_latent_length``
    latent (normed where ``ffn_routed_norm``) renormalised where ``expert_weights_norm``, SiTU's
    betas (llama.cpp's up branch untouched where its beta is not positive) and attention
    residuals in blocks of ``attn_res.block_size`` (none where 0)."""
    arch = "kimi-k3"
    _check_gating(arch, "kimi_k3", g("expert_gating_func"), (_SIGMOID_GATING,))
    settings = _kimi_linear_config(g, count, real, optional, experts, tensors, config,
                                   rope_dims, arch)
    settings["linear_attn_config"].update(use_full_rank_gate=True)
    if g("kda.gate_lower_bound") is not None:
        settings["linear_attn_config"]["gate_lower_bound"] = real("kda.gate_lower_bound")
    linear_beta = real("activation.situ_linear_beta")
    block = optional("attn_res.block_size")
    return {**settings, "hidden_act": "situ",
            "activation_situ_beta": positive("activation.situ_beta"),
            "activation_situ_linear_beta": linear_beta if linear_beta > 0 else None,
            "attn_res_block_size": block or None,
            "mla_use_output_gate": any(n.endswith(".attn_gate.weight") for n in tensors),
            "routed_expert_hidden_size": optional("expert_latent_length") or None,
            "latent_moe_use_norm": any(".ffn_routed_norm." in n for n in tensors),
            "moe_renormalize": bool(g("expert_weights_norm", False)),
            "tie_word_embeddings": False}


def _bailingmoe3_config(g: Any, count: Any, real: Any, optional: Any, experts: Any,
                        tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's bailing_moe_v3 settings of a GGUF, read as llama.cpp reads it: Kimi Delta
    Attention (``attention.head_count`` heads ``kda.head_dim`` wide, ``ssm.conv_kernel``, the
    safe gate's ``kda.gate_lower_bound``) where a layer has no key/value heads, gated latent
    attention (traditional RoPE) every ``layer_group_size``-th layer and in the last ones as
    mlx-lm places it (another layout refused), sigmoid-routed experts in groups, renormalised
    and scaled, beside one shared MLP ``expert_shared_feed_forward_length`` wide, from
    ``leading_dense_block_count`` on; what mlx-lm's model does not compute refused (another
    gating, unrenormalised weights, SwiGLU clamps). The KDA q/k norms' epsilon is mlx-lm's 1e-6
    (llama.cpp's: the GGUF's)."""
    arch, n_layers = "bailingmoe3", config["num_hidden_layers"]
    kv = _hybrid_kv_heads(arch, g, count, config, "Kimi Delta Attention")
    group = next(i for i, n in enumerate(kv) if n) + 1
    if [bool(n) for n in kv] != [(i + 1) % group == 0 or i >= n_layers // group * group
                                 for i in range(n_layers)]:
        raise UserInputError(f"GGUF {arch} with attention in layers "
                             f"{[i for i, n in enumerate(kv) if n]} is not supported (mlx-lm's "
                             "bailing_moe_v3 takes it every layer_group_size-th layer)")
    _check_gating(arch, "bailing_moe_v3", g("expert_gating_func"), (_SIGMOID_GATING,))
    if not g("expert_weights_norm", False):
        raise UserInputError(f"GGUF {arch} without renormalised expert weights "
                             "(expert_weights_norm) is not supported (mlx-lm's bailing_moe_v3 "
                             "renormalises them)")
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        if any(np.atleast_1d(g(key, 0.0))):
            raise UserInputError(f"GGUF {arch} with {key} is not supported (mlx-lm's "
                                 "bailing_moe_v3 clamps no SwiGLU)")
    if not g("kda.safe_gate", True) or real("kda.gate_lower_bound") >= 0:
        raise UserInputError(f"GGUF {arch} needs a safe KDA gate with a negative "
                             "kda.gate_lower_bound (llama.cpp asserts both)")
    n_experts, n_used = experts()
    ff_exp = count("expert_feed_forward_length")
    latent = _latent_attention(arch, count, tensors, config, rope_dims)
    return {**latent, "head_dim": count("kda.head_dim"),
            "v_head_dim": count("attention.value_length_mla"), "layer_group_size": group,
            "short_conv_kernel_size": count("ssm.conv_kernel"),
            "kda_lower_bound": real("kda.gate_lower_bound"), "kda_safe_gate": True,
            "no_kda_lora": True, "rope_interleave": True,
            "num_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": ff_exp, "num_shared_experts": 1,
            "moe_shared_expert_intermediate_size": count(
                "expert_shared_feed_forward_length",
                ff_exp * max(1, count("expert_shared_count", least=0))),
            "first_k_dense_replace": _leading_dense(arch, optional, n_layers),
            "n_group": optional("expert_group_count") or 1,
            "topk_group": optional("expert_group_used_count") or 1,
            "routed_scaling_factor": real("expert_weights_scale", 0.0) or 1.0}


def _minicpm3_config(g: Any, count: Any, tensors: dict, config: dict, rope_dims: int) -> dict:
    """mlx-lm's minicpm3 settings of a GGUF, read as llama.cpp reads it: latent attention
    (:func:`_latent_attention`; llama.cpp requires the q rank) whose values are hidden / heads
    wide (mlx-lm's), MiniCPM's scales as llama.cpp hard-wires them (:data:`MINICPM3_SCALES`;
    a head of its own, ``glm4_tensors``'), no biases, and LongRoPE: llama.cpp turns by the
    short factors (none: 1) up to the original context, which its converter leaves at the
    model's context, and mlx-lm's SuScaledRoPE by its long ones at every length: the short
    factors go there, the scale 1 (an attn_factor other than 1 is refused by the caller)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    values = count("attention.value_length", hidden // heads)
    if values * heads != hidden:
        raise UserInputError(f"GGUF minicpm3 with {heads} heads of values {values} wide is not "
                             f"supported (mlx-lm's minicpm3 takes hidden / heads: "
                             f"{hidden / heads:g})")
    context, long, short = (config["max_position_embeddings"], *_LONGROPE.values())
    short = (_rope_factors(short, tensors, rope_dims) if short in tensors
             else np.ones(rope_dims // 2, np.float32))
    if count("rope.scaling.original_context_length", context) < context and long in tensors \
            and not np.array_equal(_rope_factors(long, tensors, rope_dims), short):
        raise UserInputError("GGUF minicpm3 with an original context shorter than its context "
                             "and long RoPE factors of their own is not supported (mlx-lm's "
                             "minicpm3 turns by one set of factors at every length)")
    return {**_latent_attention("minicpm3", count, tensors, config, rope_dims),
            **MINICPM3_SCALES, "tie_word_embeddings": False, "attention_bias": False,
            "rope_scaling": {"type": "longrope", "original_max_position_embeddings": context,
                             **dict.fromkeys(("short_factor", "long_factor"),
                                             [float(str(v)) for v in short.astype(np.float32)])}}


def _local_layers(pattern: Any, n_layers: int, arch: str, dense_first: bool = False) -> list[bool]:
    """Which layers slide, by a GGUF's sliding-window pattern: a flag per layer, or llama.cpp's
    period n (n - 1 local layers, then a global one, or with ``dense_first`` the global one
    first; 0: every layer local)."""
    key = f"GGUF metadata {arch}.attention.sliding_window_pattern"
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise UserInputError(f"{key} has {len(pattern)} flags for {n_layers} layers")
        return [bool(x) for x in pattern]
    if isinstance(pattern, (int, np.integer)) and not isinstance(pattern, (bool, np.bool_)) \
            and 0 <= pattern <= _MAX_COUNT:
        return [pattern == 0 or (i % pattern != 0 if dense_first else i % pattern < pattern - 1)
                for i in range(n_layers)]
    raise UserInputError(f"{key} must be a flag per layer or a period, got "
                         f"{shown(pattern, 40)}")


def _sliding_pattern(pattern: Any, n_layers: int, arch: str) -> str | None:
    """A GGUF's sliding-window pattern (:func:`_local_layers`) as mlx-lm's string of L (local)
    and G (global) repeated over the layers, the shortest; None when no layer is local."""
    local = _local_layers(pattern, n_layers, arch)
    if not any(local):
        return None
    if all(local):
        raise UserInputError(f"GGUF {arch} with a sliding window in every layer is not "
                             f"supported (mlx-lm's {arch} needs a global layer)")
    size = next(n for n in range(1, n_layers + 1)
                if all(x == local[i % n] for i, x in enumerate(local)))
    return "".join("L" if x else "G" for x in local[:size])


def _number(x: float) -> int | float:
    """``x`` to 6 significant digits, an int when whole: 8192, not 8191.999999999998."""
    x = float(f"{x:.6g}")
    return int(x) if x.is_integer() else x


def _rope_factors(name: str, tensors: dict, dims: int) -> np.ndarray:
    """The GGUF tensor ``name``, which must hold a positive number per RoPE frequency of
    ``dims`` dims."""
    x, what = dequantized(tensors[name]), name.removesuffix(".weight")
    if x.shape != (dims // 2,):
        raise UserInputError(f"GGUF {what} must hold {dims // 2} numbers (one per RoPE "
                             f"frequency), got shape {x.shape}")
    if not np.all(np.isfinite(x)) or x.min() <= 0:
        bad = x[~(np.isfinite(x) & (x > 0))][0]
        raise UserInputError(f"GGUF {what} must be positive numbers, got {bad}")
    return x


def _longrope_scaling(arch: str, tensors: dict, dims: int) -> dict:
    """Phi-3's LongRoPE ``rope_scaling`` from llama.cpp's ``rope_factors_long`` and
    ``rope_factors_short`` tensors: what each RoPE frequency's wavelength is multiplied by
    beyond the original context and within it. (llama.cpp picks by the context it runs with;
    mlx-lm's SuScaledRoPE takes the long factors at any length, as for the Hugging Face
    checkpoint.)"""
    missing = [name for name in _LONGROPE.values() if name not in tensors]
    if missing:
        raise UserInputError(f"GGUF {arch} lacks {missing[0]}: LongRoPE needs "
                             f"{' and '.join(_LONGROPE.values())}")
    # float32 as llama.cpp writes them; each as its shortest decimal, as the original config has it
    return {"type": "longrope", **{
        key: [float(str(v)) for v in _rope_factors(name, tensors, dims).astype(np.float32)]
        for key, name in _LONGROPE.items()}}


def _gpt_oss_windows(g: Any, count: Any, n_layers: int) -> dict:
    """gpt-oss's sliding window and its layers' kinds, by llama.cpp's pattern period
    (:func:`_local_layers`; mlx-lm's gpt_oss needs both kinds)."""
    period = count("attention.sliding_window_pattern", GPT_OSS_SLIDING_PATTERN)
    kinds = ["sliding_attention" if local else "full_attention"
             for local in _local_layers(period, n_layers, "gpt-oss")]
    missing = {"sliding_attention", "full_attention"} - set(kinds)
    if missing:
        raise UserInputError(f"GGUF gpt-oss without a {missing.pop().replace('_', ' ')} layer "
                             f"(sliding window pattern {period}, {n_layers} layers) is not "
                             "supported")
    return {"sliding_window": count("attention.sliding_window"), "layer_types": kinds}


def _gemma4_config(g: Any, count: Any, positive: Any, optional: Any, experts: Any,
                   tensors: dict, config: dict) -> dict:
    """mlx-lm's gemma4_text settings of a Gemma 4 GGUF, read as llama.cpp reads it.

    Sliding layers by a flag each; their heads ``key_length_swa`` wide, the global layers'
    ``key_length``; RoPE over all of a sliding head at ``rope.freq_base_swa``, and over the
    first frequencies of a global head at ``rope.freq_base`` (the ``rope_freqs`` tensor: mlx-lm's
    proportional RoPE); key/value heads per layer (one count per kind); values from the keys'
    projection where a global layer has no ``attn_v``; the last ``shared_kv_layers`` layers
    reading the keys and values of the last layers of their kind below them, their MLPs twice
    as wide where ``feed_forward_length`` says so (E2B/E4B); per-layer inputs; an MoE beside
    the MLP in every layer (26B A4B). Any other layout is a :class:`UserInputError`.
    """
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    per_layer = partial(_per_layer, "gemma4", g, count, n_layers)

    flags = g("attention.sliding_window_pattern")
    if not isinstance(flags, list) or len(flags) != n_layers:
        raise UserInputError("GGUF metadata gemma4.attention.sliding_window_pattern must be a "
                             f"flag per layer ({n_layers}), got {shown(flags, 40)}")
    local = [bool(x) for x in flags]
    swa_dim = count("attention.key_length_swa")
    for key, dim in (("attention.value_length", head_dim), ("attention.value_length_swa", swa_dim)):
        if count(key, dim) != dim:  # llama.cpp refuses it too
            raise UserInputError(f"GGUF gemma4 whose {key} differs from its key length is not "
                                 "supported")
    rot_swa = count("rope.dimension_count_swa", head_dim)  # llama.cpp: the global layers'
    if rot_swa != swa_dim:
        raise UserInputError(f"GGUF gemma4 with RoPE over {rot_swa} of its sliding layers' "
                             f"{swa_dim} head dims is not supported")
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if not all(local):
        if "rope_freqs.weight" not in tensors:  # llama.cpp requires it too
            raise UserInputError("GGUF gemma4 lacks rope_freqs.weight (its global layers' "
                                 "partial RoPE)")
        full_rope.update(_gemma4_proportional_rope(tensors, head_dim))

    n_shared = optional("attention.shared_kv_layers")
    first_shared = n_layers - n_shared
    if n_shared and first_shared < 2:  # llama.cpp asserts as much
        raise UserInputError(f"GGUF metadata gemma4.attention.shared_kv_layers ({n_shared}) "
                             f"leaves fewer than 2 of {n_layers} layers their own keys")
    _check_shared_kv("gemma4", local, first_shared)
    kv = per_layer("attention.head_count_kv", config["num_attention_heads"])
    heads = {}
    for kind in (True, False):
        counts = {n for n, x in zip(kv, local) if x == kind}
        if len(counts) > 1:
            raise UserInputError(f"GGUF gemma4 with {'sliding' if kind else 'global'} layers of "
                                 f"{' and '.join(map(str, sorted(counts)))} key/value heads is "
                                 "not supported")
        heads[kind] = counts.pop() if counts else None
    global_kv = [i for i in range(first_shared) if not local[i]]
    without_v = [i for i in global_kv if f"blk.{i}.attn_v.weight" not in tensors]
    if without_v and without_v != global_kv:
        raise UserInputError(f"GGUF gemma4 with values from the keys' projection in global "
                             f"layer {without_v[0]} but not in layer "
                             f"{sorted(set(global_kv) - set(without_v))[0]} is not supported")
    k_eq_v = bool(without_v)
    n_kv = heads[True] if heads[True] is not None else heads[False]
    if heads[False] not in (None, n_kv) and not k_eq_v:
        raise UserInputError(f"GGUF gemma4 with {heads[False]} key/value heads in its global "
                             f"layers and {n_kv} in its sliding ones is not supported where "
                             "global layers project values of their own (mlx-lm's gemma4_text)")

    ff = per_layer("feed_forward_length")
    width = ff[0]
    double = n_shared > 0 and ff == [width] * first_shared + [2 * width] * n_shared
    if not double and ff != [width] * n_layers:
        raise UserInputError("GGUF gemma4 with MLP widths by layer other than E2B/E4B's (twice "
                             "as wide in the layers sharing keys) is not supported")

    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n_layers)]
    sparse: dict[str, Any] = {"enable_moe_block": all(moe)}
    if any(moe) and not all(moe):
        raise UserInputError(f"GGUF gemma4 with experts in {sum(moe)} of its {n_layers} layers "
                             "is not supported (mlx-lm's gemma4_text has them in all or none)")
    if all(moe):
        n_experts, n_used = experts()
        widths = set(per_layer("expert_feed_forward_length"))
        if len(widths) > 1:
            raise UserInputError("GGUF gemma4 with experts of different widths by layer is not "
                                 "supported")
        sparse.update(num_experts=n_experts, top_k_experts=n_used,
                      moe_intermediate_size=widths.pop())

    per_input = optional("embedding_length_per_layer_input")
    softcap = g("final_logit_softcapping", GEMMA4_LOGIT_SOFTCAP)
    return {
        "hidden_act": "gelu_pytorch_tanh", "head_dim": swa_dim, "global_head_dim": head_dim,
        "num_key_value_heads": n_kv,
        "num_global_key_value_heads": heads[False] if k_eq_v else None,
        "attention_k_eq_v": k_eq_v, "intermediate_size": width, "use_double_wide_mlp": double,
        "num_kv_shared_layers": n_shared, "hidden_size_per_layer_input": per_input,
        "vocab_size_per_layer_input": _per_layer_vocabulary(tensors, config),
        "sliding_window": count("attention.sliding_window"),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 1.0,
                                  "rope_theta": positive("rope.freq_base_swa",
                                                         GEMMA4_LOCAL_ROPE_BASE)}},
        # llama.cpp: 0 caps nothing
        "final_logit_softcapping": (positive("final_logit_softcapping", GEMMA4_LOGIT_SOFTCAP)
                                    if softcap else None),
        **sparse,
    }


def _check_shared_kv(arch: str, local: list[bool], first_shared: int) -> None:
    """Refuse a Gemma 4 or 3n GGUF whose layers from ``first_shared`` on would read other keys
    and values in llama.cpp (the layer 2 or 1 below the first shared one, by kind) than in
    mlx-lm (the last layer of its kind below it), ``local`` the sliding layers."""
    for i in range(first_shared, len(local)):
        source = first_shared - (2 if local[i] else 1)
        own = [j for j in range(first_shared) if local[j] == local[i]]
        if not own or own[-1] != source:
            raise UserInputError(f"GGUF {arch} whose layer {i} reads the keys of layer {source} "
                                 "(llama.cpp's rule), not of the last layer of its kind below "
                                 "the shared ones (mlx-lm's), is not supported")


def _gemma3n_config(g: Any, count: Any, positive: Any, optional: Any, tensors: dict,
                    config: dict) -> dict:
    """mlx-lm's gemma3n text settings of a Gemma 3n GGUF, read as llama.cpp reads it: sliding
    layers by a flag each or a period (5 unless given), MLP widths by layer, the per-layer
    inputs' width, LAuReL's rank from its tensor, and what llama.cpp's graph hard-wires
    (:data:`GEMMA3N_STREAMS` and the rest); metadata that says otherwise, a head of its own, or
    no sliding or no global layer among those with keys (mlx-lm's gemma3n indexes both) is a
    :class:`UserInputError`."""
    n_layers = config["num_hidden_layers"]
    local = _local_layers(g("attention.sliding_window_pattern", 5), n_layers, "gemma3n")
    first_shared = min(n_layers, GEMMA3N_KV_LAYERS)
    if all(local[:first_shared]) or not any(local[:first_shared]):
        raise UserInputError(f"GGUF gemma3n with {'no' if all(local[:first_shared]) else 'only'} "
                             "global layers among those with keys of their own is not "
                             "supported (mlx-lm's gemma3n needs both kinds)")
    _check_shared_kv("gemma3n", local, first_shared)
    sparse = min(n_layers, GEMMA3N_SPARSE_LAYERS)
    cut = NormalDist().inv_cdf(GEMMA3N_SPARSITY)  # what llama.cpp's converter writes
    written = {"altup.num_inputs": (g("altup.num_inputs"), GEMMA3N_STREAMS),
               "altup.active_idx": (g("altup.active_idx"), 0),
               "attention.shared_kv_layers": (g("attention.shared_kv_layers"),
                                              n_layers - first_shared),
               "final_logit_softcapping": (g("final_logit_softcapping"), GEMMA3N_LOGIT_SOFTCAP),
               "activation_sparsity_scale": (g("activation_sparsity_scale"),
                                             [cut] * sparse + [-np.inf] * (n_layers - sparse))}
    for key, (value, wired) in written.items():
        try:
            agrees = value is None or np.allclose(np.asarray(value, np.float64), wired, rtol=1e-6)
        except (TypeError, ValueError):  # not numbers, or not one per layer
            agrees = False
        if not agrees:
            raise UserInputError(f"GGUF metadata gemma3n.{key} is {shown(value, 40)}; llama.cpp's "
                                 f"graph hard-wires {shown(wired, 40)}")
    if "output.weight" in tensors:
        raise UserInputError("GGUF gemma3n with a head of its own (output.weight) is not "
                             "supported (mlx-lm's gemma3n's head is the embedding)")
    ff = _per_layer("gemma3n", g, count, n_layers, "feed_forward_length")
    laurel = tensors.get("blk.0.laurel_l.weight")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": ff[0] if ff == [ff[0]] * n_layers else ff,
        "num_kv_shared_layers": n_layers - first_shared,
        "hidden_size_per_layer_input": count("embedding_length_per_layer_input", 256),
        "vocab_size_per_layer_input": _per_layer_vocabulary(tensors, config),
        "laurel_rank": int(laurel.shape[1]) if laurel is not None else 64,
        "sliding_window": count("attention.sliding_window"),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "rope_local_base_freq": positive("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE),
        "final_logit_softcapping": GEMMA3N_LOGIT_SOFTCAP,
        "activation_sparsity_pattern": [GEMMA3N_SPARSITY] * sparse + [0.0] * (n_layers - sparse),
        # no clip of AltUp's coefficients (llama.cpp has none; transformers' config, which
        # loading the tokenizer reads, wants a number)
        "altup_num_inputs": GEMMA3N_STREAMS, "altup_active_idx": 0,
        "altup_coef_clip": float(np.finfo(np.float32).max), "altup_correct_scale": True,
    }


def _per_layer_vocabulary(tensors: dict, config: dict) -> int:
    """Gemma 4's and 3n's per-layer inputs: the rows of their embedding (llama.cpp reads every
    one by token id, the zero rows its converter pads with too), the vocabulary without one."""
    embd = tensors.get("per_layer_token_embd.weight")
    return int(embd.shape[1]) if embd is not None else config["vocab_size"]


def _per_layer(arch: str, g: Any, count: Any, n_layers: int, key: str,
               default: Any = None, least: int = 1) -> list[int]:
    """A count (``least`` or more) for each layer: one for all, or llama.cpp's array of them."""
    value = g(key, default)
    if not isinstance(value, list):
        return [count(key, default, least=least)] * n_layers
    if len(value) != n_layers:
        raise UserInputError(f"GGUF metadata {arch}.{key} has {len(value)} values for "
                             f"{n_layers} layers")
    return [count(key, value=v, least=least) for v in value]


def _laguna_config(g: Any, count: Any, real: Any, positive: Any, optional: Any, experts: Any,
                   tensors: dict, config: dict, rotary: float | None,
                   yarn: dict | None) -> dict:
    """mlx-lm's laguna settings of a Laguna GGUF, read as llama.cpp reads it: query heads by
    layer, each layer's output gate one per head (a per-element one refused); with a window,
    llama.cpp's pattern (flags, or a period: 4, a global layer first, unless given), the sliding
    layers' plain RoPE at rope.freq_base_swa over rope.dimension_count_swa dims, the global
    ones' (YaRN ``yarn``, or none) over ``rotary`` of each head; without, every layer global;
    leading_dense_block_count dense layers, then sigmoid-routed experts (a correction bias, the
    top weights renormalised as mlx-lm's always are, scaled by expert_weights_scale) beside a
    shared expert."""
    n_layers, d = config["num_hidden_layers"], config["head_dim"]
    heads = _per_layer("laguna", g, count, n_layers, "attention.head_count")
    for layer, n in enumerate(heads):
        gate = tensors.get(f"blk.{layer}.attn_gate.weight")
        if gate is not None and int(gate.shape[1]) != n:
            raise UserInputError(f"GGUF laguna with an output gate {int(gate.shape[1])} wide in "
                                 f"layer {layer} is not supported (mlx-lm's laguna gates each "
                                 f"of its {n} heads)")
    n_experts, n_used = experts()
    if not g("expert_weights_norm", False) or \
            g("expert_gating_func", _SIGMOID_GATING) != _SIGMOID_GATING:
        raise UserInputError("GGUF laguna whose experts' weights are not renormalised or not "
                             "routed by sigmoid is not supported (mlx-lm's laguna does both)")
    window = optional("attention.sliding_window")
    local = (_local_layers(g("attention.sliding_window_pattern", LAGUNA_SLIDING_PATTERN),
                           n_layers, "laguna", dense_first=True) if window else [False] * n_layers)
    if all(local):
        raise UserInputError("GGUF laguna with a sliding window in every layer is not supported "
                             "(mlx-lm's laguna needs a global layer)")
    full = {"rope_type": "default", "rope_theta": config["rope_theta"],
            "partial_rotary_factor": rotary or 1.0}
    if yarn is not None:  # llama.cpp's betas unless the GGUF gives them
        full.update(yarn, **{key: positive(f"rope.scaling.yarn_{key}", value)
                             for key, value in LLAMA_CPP_YARN_BETAS.items()})
    swa_dims = count("rope.dimension_count_swa", d)
    sliding = {"rope_type": "default", "rope_theta": positive("rope.freq_base_swa",
                                                                config["rope_theta"]),
               "partial_rotary_factor": _rotary_factor(swa_dims, d)}
    if sliding["partial_rotary_factor"] is None:
        raise UserInputError(f"GGUF laguna with RoPE over {swa_dims} of each head's {d} dims in "
                             "its sliding layers is not supported")
    dense = optional("leading_dense_block_count")
    # no window: the key left out (transformers' config, which loading the tokenizer reads,
    # takes no null; no layer slides)
    return {"num_attention_heads": max(heads), "num_attention_heads_per_layer": heads,
            **({"sliding_window": window} if window else {}), "gating": True,
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n_layers)],
            "num_experts": n_experts, "num_experts_per_tok": n_used,
            "moe_intermediate_size": count("expert_feed_forward_length"),
            "shared_expert_intermediate_size": count("expert_shared_feed_forward_length"),
            "moe_routed_scaling_factor": real("expert_weights_scale", 1.0),
            "moe_router_score_func": "sigmoid", "qkv_bias": False, "attention_bias": False}


def _muse_glimmer_config(g: Any, count: Any, positive: Any, tensors: dict, config: dict) -> dict:
    """mlx-lm's muse_glimmer settings of a Muse Glimmer GGUF, read as llama.cpp reads it: the
    window (required) in llama.cpp's pattern (flags, or a period: 4 unless given), RoPE in the
    sliding layers only at rope.freq_base_swa (rope.freq_base unless given); the q/k norm
    weights, which llama.cpp's converter makes of qk_scale_factor (the queries') and ones (the
    keys'), as that factor; the logits times logit_scale, then soft-capped."""
    arch, n_layers = "muse-glimmer", config["num_hidden_layers"]
    if g("final_logit_softcapping") is None:
        raise UserInputError("GGUF muse-glimmer without a final logit soft-cap is not supported "
                             "(mlx-lm's muse_glimmer always soft-caps its logits)")
    norms = {p: [tensors.get(f"blk.{i}.attn_{p}_norm.weight") for i in range(n_layers)]
             for p in "qk"}
    if any(t is None for ts in norms.values() for t in ts):
        raise UserInputError("GGUF muse-glimmer lacks a layer's attn_q_norm or attn_k_norm "
                             "(llama.cpp requires both)")
    q, k = (np.concatenate([dequantized(t).ravel() for t in norms[p]]) for p in "qk")
    if not (np.all(q == q[0]) and np.all(k == 1)):
        raise UserInputError("GGUF muse-glimmer whose q/k norm weights are not one query scale "
                             "and ones is not supported (mlx-lm's muse_glimmer scales every "
                             "query by one qk_scale_factor)")
    local = _local_layers(g("attention.sliding_window_pattern", MUSE_GLIMMER_SLIDING_PATTERN),
                          n_layers, arch)
    return {"sliding_window": count("attention.sliding_window"),
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "rope_theta": positive("rope.freq_base_swa", config["rope_theta"]),
            "qk_scale_factor": float(str(np.float32(q[0]))),
            "output_multiplier": positive("logit_scale"),
            "final_logit_softcapping": positive("final_logit_softcapping"),
            "post_norm_eps": MUSE_GLIMMER_POST_NORM_EPS}


def _spark2_5_config(g: Any, count: Any, positive: Any, config: dict,
                     rotary: float | None) -> dict:
    """mlx-lm's spark2_5 settings of a Spark 2.5 GGUF, read as llama.cpp reads it: the window
    and its pattern (a flag per layer; both required), the global layers' RoPE over ``rotary``
    of each head at rope.freq_base, the sliding ones' over rope.dimension_count_swa dims at
    rope.freq_base_swa (the global ones' unless given); a GELU MLP, no biases (llama.cpp reads
    none)."""
    arch, n_layers, d = "spark2_5", config["num_hidden_layers"], config["head_dim"]
    if g("attention.sliding_window_pattern") is None:  # llama.cpp requires it
        raise UserInputError(f"GGUF metadata lacks {arch}.attention.sliding_window_pattern")
    local = _local_layers(g("attention.sliding_window_pattern"), n_layers, arch)
    swa_dims = count("rope.dimension_count_swa", int(d * (rotary or 1.0)))
    swa_rotary = _rotary_factor(swa_dims, d)
    if swa_rotary is None or swa_dims % 2:
        raise UserInputError(f"GGUF {arch} with RoPE over {swa_dims} of each head's {d} dims in "
                             "its sliding layers is not supported")
    return {"sliding_window": count("attention.sliding_window"),
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "rope_parameters": {
                "full_attention": {"rope_theta": config["rope_theta"],
                                   "partial_rotary_factor": rotary or 1.0},
                "sliding_attention": {"rope_theta": positive("rope.freq_base_swa",
                                                             config["rope_theta"]),
                                      "partial_rotary_factor": swa_rotary}},
            "hidden_act": "gelu", "attention_bias": False, "mlp_bias": False}


def _deci_config(g: Any, count: Any, config: dict) -> dict:
    """mlx-lm's nemotron-nas settings of a deci GGUF, read as llama.cpp reads it: each layer's
    heads, key/value heads and MLP width as its ``block_configs`` entry (no heads: no attention;
    heads but no key/value heads: a linear map; no width: no MLP), a width as mlx-lm derives it
    from ``ffn_mult`` (a multiple of 256, as llama.cpp's converter writes it), every attention
    layer with the model's heads (mlx-lm's take one count); no biases (llama.cpp reads none but
    the output's, which mlx-lm's model takes only with q/k/v ones: refused by the shape check).
    """
    n_layers, heads, hidden = (config["num_hidden_layers"], config["num_attention_heads"],
                               config["hidden_size"])
    per_layer = partial(_per_layer, "deci", g, count, n_layers, least=0)
    q, kv = per_layer("attention.head_count"), per_layer("attention.head_count_kv", heads)
    widths = per_layer("feed_forward_length")
    nas = importlib.import_module("mlx_lm.models.nemotron-nas")
    blocks = []
    for layer, (n_q, n_kv, width) in enumerate(zip(q, kv, widths)):
        mult = 3 * width / (2 * hidden)  # mlx-lm's width of it: int(2 mult hidden / 3), rounded
        # up to a multiple of 256 (the multiplier first to 6 decimals, as its config does)
        if n_q not in (0, heads) or (n_kv and n_q % n_kv) or (n_kv and not n_q) or \
                (width and width != nas._ffn_mult_to_intermediate_size(round(mult, 6), hidden)):
            raise UserInputError(f"GGUF deci with {n_q} heads over {n_kv} key/value heads and "
                                 f"an MLP {width} wide in layer {layer} is not supported "
                                 f"(mlx-lm's nemotron-nas takes 0 or {heads} heads, groups of "
                                 "them, widths of multiples of 256)")
        attention = ({"no_op": True} if not n_q else {"replace_with_linear": True} if not n_kv
                     else {"n_heads_in_group": n_q // n_kv})
        blocks.append({"attention": attention,
                       "ffn": {"ffn_mult": mult} if width else {"no_op": True}})
    if not any(kv):
        raise UserInputError("GGUF deci without an attention layer is not supported (mlx-lazy "
                             "runs models with at least one)")
    return {"block_configs": blocks, "attention_bias": False, "mlp_bias": False}


def _openelm_config(g: Any, count: Any, config: dict) -> dict:
    """mlx-lm's openelm settings of an OpenELM GGUF, read as llama.cpp reads it: query and
    key/value heads (as many as the queries where the GGUF gives none) and the MLP's width per
    layer, each width as mlx-lm derives it from a multiplier (the width over the hidden size,
    rounded to a multiple of 1: the width itself); RoPE over whole heads, per-head q/k norms
    (llama.cpp hard-wires both); the head tied unless the GGUF has one of its own."""
    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    per_layer = partial(_per_layer, "openelm", g, count, n_layers)
    heads = per_layer("attention.head_count")
    kv = per_layer("attention.head_count_kv") if g("attention.head_count_kv") is not None \
        else heads
    for layer, (q, k) in enumerate(zip(heads, kv)):
        if q % k:  # mlx-lm's attention repeats each key/value head for whole groups of queries
            raise UserInputError(f"GGUF openelm with {q} query heads over {k} key/value heads "
                                 f"in layer {layer} is not supported")
    return {"model_dim": hidden, "num_transformer_layers": n_layers,
            "num_query_heads": heads, "num_kv_heads": kv,
            "ffn_multipliers": [w / hidden for w in per_layer("feed_forward_length")],
            "ffn_dim_divisor": 1, "ffn_with_glu": True, "normalize_qk_projections": True,
            "share_input_output_layers": config["tie_word_embeddings"],
            "rope_freq_constant": config["rope_theta"]}


def _ernie45_moe_config(count: Any, optional: Any, experts: Any) -> dict:
    """mlx-lm's ernie4_5_moe settings of an ERNIE 4.5 MoE GGUF, read as llama.cpp reads it:
    sparse layers from ``leading_dense_block_count`` (0 without it) on, every
    ``interleave_moe_layer_step``-th; the top experts' softmax weights renormalised (hard-wired
    in llama.cpp); shared experts ``expert_shared_feed_forward_length`` wide in all (none
    without it), which mlx-lm's model takes as a number of experts' widths."""
    n_experts, n_used = experts()
    width, shared = count("expert_feed_forward_length"), optional(
        "expert_shared_feed_forward_length")
    if shared % width:
        raise UserInputError(f"GGUF ernie4_5-moe with shared experts {shared} wide, not a "
                             f"multiple of its experts' {width}, is not supported")
    return {"moe_num_experts": n_experts, "moe_k": n_used, "moe_intermediate_size": width,
            "moe_num_shared_experts": shared // width,
            "moe_layer_start_index": optional("leading_dense_block_count"),
            "moe_layer_interval": count("interleave_moe_layer_step"), "moe_gate_act": "softmax"}


def _gemma4_proportional_rope(tensors: dict, dims: int) -> dict:
    """Gemma 4's global layers' RoPE from llama.cpp's ``rope_freqs``: the divisor of each
    frequency of a ``dims``-wide head, one (f) for the first frequencies and 1e30 (none) for
    the rest, which stay unrotated: mlx-lm's proportional RoPE over that share of the head
    (its frequencies those of the whole head, times f where f is not 1)."""
    x = _rope_factors("rope_freqs.weight", tensors, dims).astype(np.float64)
    rotated = int(np.argmax(x >= GEMMA4_UNROTATED)) if (x >= GEMMA4_UNROTATED).any() else len(x)
    if rotated == 0 or not np.allclose(x[:rotated], x[0], rtol=1e-6, atol=0):
        raise UserInputError("GGUF gemma4 rope_freqs are not Gemma 4's proportional RoPE (one "
                             "divisor for the first frequencies, 1e30 for the unrotated rest)")
    share = _rotary_factor(2 * rotated, dims)
    if share is None:
        raise UserInputError(f"GGUF gemma4 with RoPE over {2 * rotated} of its global layers' "
                             f"{dims} head dims is not supported")
    factor = float(str(np.float32(x[0])))  # as llama.cpp writes it, in float32
    return {"rope_type": "proportional", "partial_rotary_factor": share,
            **({"factor": factor} if factor != 1 else {})}


def _rotary_factor(rotated: int, dims: int) -> float | None:
    """mlx-lm's ``partial_rotary_factor`` of RoPE over the first ``rotated`` of a head's ``dims``
    dims; None where its models, which rotate int(dims · factor) dims, would rotate another
    number (more than the head has, or a float's rounding one fewer)."""
    if rotated > dims:
        return None
    factor = rotated / dims
    return factor if int(dims * factor) == rotated else None


def _rope_scaling(config: dict) -> dict:
    """The RoPE scaling of mlx-lm's ``config``: its ``rope_scaling``, or ministral3's
    ``rope_parameters``."""
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def _llama_cpp_yarn_magnitude(config: dict) -> float:
    """What llama.cpp's YaRN multiplies the rotated dims of queries and keys by besides the
    GGUF's attn_factor: (0.1 s ln f + 1) / (0.1 m ln f + 1) for the factor f and the log
    multiplier m (``mscale_all_dim``: 0 where the GGUF has none, and in the gpt-oss loader,
    which reads none), llama-context.cpp taking mscale s as 1 (but as m in deepseek2: the
    config's ``mscale``); 1 without YaRN."""
    scaling = _rope_scaling(config)
    factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "yarn" else 1.0
    if factor <= 1:
        return 1.0
    return ((0.1 * scaling.get("mscale", 1.0) * math.log(factor) + 1)
            / (0.1 * scaling.get("mscale_all_dim", 0.0) * math.log(factor) + 1))


def _rope_scale(config: dict, dims: int) -> float:
    """What mlx-lm's RoPE for ``config`` multiplies the rotated dims of queries and keys by."""
    from mlx_lm.models.rope_utils import SuScaledRoPE, initialize_rope

    scaling = _rope_scaling(config)
    if scaling.get("rope_type") == "yarn":
        return initialize_rope(dims, config["rope_theta"], False, scaling).mscale
    if scaling.get("type") != "longrope":
        return 1.0
    return SuScaledRoPE(dims, base=config["rope_theta"],
                        max_position_embeddings=config["max_position_embeddings"],
                        original_max_position_embeddings=scaling.get(
                            "original_max_position_embeddings",
                            config.get("original_max_position_embeddings")),
                        long_factor=scaling["long_factor"],
                        long_mscale=scaling.get("long_mscale"))._scale  # phimoe's


def _llama3_rope_scaling(divisors: np.ndarray, base: float, dims: int) -> dict:
    """Llama 3's ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor, which holds what each
    RoPE frequency is divided by: 1 for short wavelengths, ``factor`` for long ones, between
    them 1 / ((1 − s) / factor + s) with s = (original / wavelength − low) / (high − low).

    Only the ratios of (original, low, high) are in the tensor, and the RoPE depends on no
    more: ``low_freq_factor`` is taken as 1 and the others fitted to the smoothed band. The
    result is checked against mlx-lm's own Llama 3 RoPE, so a tensor of another shape is an
    error, never a silently different RoPE.
    """
    from mlx_lm.models.rope_utils import Llama3RoPE

    d = divisors.astype(np.float64)
    factor = float(d.max())
    wavelength = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    band = ~np.isclose(d, 1.0, rtol=1e-6) & ~np.isclose(d, factor, rtol=1e-6)
    if factor <= 1 or band.sum() < 2:
        raise UserInputError("GGUF rope_freqs are not Llama 3's RoPE scaling (no smoothed band "
                             "between unscaled and scaled frequencies)")
    # s · (high − 1) − original / wavelength = s − 1, linear in (high, original)
    smooth = (1 / d[band] - 1 / factor) / (1 - 1 / factor)
    a = np.stack([smooth, -1 / wavelength[band]], axis=1)
    high, original = np.linalg.lstsq(a, smooth - 1, rcond=None)[0]
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(_number(high)),
               "original_max_position_embeddings": _number(original)}
    # float32 powers of the base: ~1e-6 relative; another scaling's divisors miss by far more
    expected = np.asarray(base ** (mx.arange(0, dims, 2) / dims)) * d
    got = np.asarray(Llama3RoPE(dims, base=base, scaling_config=scaling)._freqs)
    if not np.allclose(got, expected, rtol=1e-4, atol=0):
        raise UserInputError("GGUF rope_freqs are not Llama 3's RoPE scaling (the fitted "
                             f"scaling misses them by {np.max(np.abs(got / expected - 1)):.2g}; "
                             "llama.cpp writes them in float32)")
    return scaling
