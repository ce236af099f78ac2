"""An independent float64 numpy reference of every block of Qwen3.6-35B-A3B and its MTP head.

Written from the equations in the shared REFERENCE.md (sections 1-5), not from qmtp's code: this module
does not import qmtp. Everything computes in float64.

Weights are a dict {internal name: float64 array} holding *effective* values:
  * zero-centred norms already shifted (1 + w),
  * the depthwise conv kernel as [C, K] (tap K-1 multiplies the newest input),
  * routed experts stacked: `mlp.experts.{gate,up}_proj.weight` [E, I, H], `mlp.experts.down_proj.weight` [E, H, I].
Names are the internal ones (`layers.3.self_attn.q_proj.weight`, `mtp.fc.weight`, ...); block functions take
the prefix of their module (e.g. "layers.3.self_attn.").

`cfg` is any object with the Hugging Face field names as attributes (hidden_size, head_dim, ...).
Linear layers follow the PyTorch convention: y = x @ W.T with W [out, in].
"""

from __future__ import annotations

import numpy as np

LINEAR = "linear_attention"
FULL = "full_attention"


# ---- elementwise ---------------------------------------------------------------------------------------------
def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def sigmoid(x):
    x = f64(x)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def silu(x):
    x = f64(x)
    return x * sigmoid(x)


def softplus(x):
    x = f64(x)
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def softmax(x, axis=-1):
    x = f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def linear(x, w):
    return f64(x) @ f64(w).T


# ---- norms ---------------------------------------------------------------------------------------------------
def rmsnorm(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis."""
    x = f64(x)
    return f64(w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gated_rmsnorm(x, z, w, eps):
    """w * rmsnorm(x) * silu(z): the output norm of gated DeltaNet (plain weight)."""
    return rmsnorm(x, w, eps) * silu(z)


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (eps added to the sum of squares)."""
    x = f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# ---- rotary position embedding ---------------------------------------------------------------------------------
def rope(x, positions, rotary_dims, theta):
    """Partial rotate-half (NeoX) RoPE on the first `rotary_dims` of the last axis.

    x [..., T, D]; positions [T]. Pair (i, i + rot/2) is rotated by angle pos * theta^(-2i/rot).
    """
    x = f64(x)
    half = rotary_dims // 2
    inv_freq = float(theta) ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dims)
    angles = f64(positions)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:rotary_dims]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dims] = x2 * cos + x1 * sin
    return out


# ---- gated full attention --------------------------------------------------------------------------------------
def gated_attention(w, prefix, x, cfg, offset=0, past=None):
    """Gated attention over x [B, T, H] at positions offset..offset+T-1.

    `past` = (keys, values) [B, Hkv, P, D] of earlier positions (keys already rotated), or None; P must equal
    `offset` when given. Returns (out [B, T, H], (keys, values) of all P + T positions).
    """
    x = f64(x)
    B, T, _ = x.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    rot = int(D * cfg.partial_rotary_factor)

    qg = linear(x, w[prefix + "q_proj.weight"]).reshape(B, T, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]  # per head: first D query, last D gate
    k = linear(x, w[prefix + "k_proj.weight"]).reshape(B, T, Hkv, D)
    v = linear(x, w[prefix + "v_proj.weight"]).reshape(B, T, Hkv, D)
    q = rmsnorm(q, w[prefix + "q_norm.weight"], eps).transpose(0, 2, 1, 3)  # [B, Hq, T, D]
    k = rmsnorm(k, w[prefix + "k_norm.weight"], eps).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    v = v.transpose(0, 2, 1, 3)

    positions = np.arange(offset, offset + T)
    q = rope(q, positions, rot, cfg.rope_theta)
    k = rope(k, positions, rot, cfg.rope_theta)
    if past is not None:
        pk, pv = past
        assert pk.shape[2] == offset, "past length must equal the position offset"
        k = np.concatenate([f64(pk), k], axis=2)
        v = np.concatenate([f64(pv), v], axis=2)
    S = k.shape[2]

    group = Hq // Hkv
    kv_of = np.arange(Hq) // group  # query head h reads KV head h // (Hq / Hkv)
    kh, vh = k[:, kv_of], v[:, kv_of]  # [B, Hq, S, D]
    scores = np.einsum("bhtd,bhsd->bhts", q, kh) / np.sqrt(D)
    q_pos = positions[:, None]
    k_pos = np.arange(S)[None, :]
    scores = np.where(k_pos <= q_pos, scores, -np.inf)
    probs = softmax(scores, axis=-1)
    out = np.einsum("bhts,bhsd->bhtd", probs, vh).transpose(0, 2, 1, 3)  # [B, T, Hq, D]
    out = (out * sigmoid(gate)).reshape(B, T, Hq * D)
    return linear(out, w[prefix + "o_proj.weight"]), (k, v)


# ---- gated DeltaNet ----------------------------------------------------------------------------------------------
def gated_deltanet(w, prefix, x, cfg, conv_state=None, state=None):
    """Gated DeltaNet over x [B, T, H].

    conv_state: the last K-1 projected qkv inputs [B, K-1, C] (zeros when None = no history);
    state: S [B, Hv, Dk, Dv] (zeros when None).
    Returns (out [B, T, H], new conv_state [B, K-1, C], new state [B, Hv, Dk, Dv]).
    """
    x = f64(x)
    B, T, _ = x.shape
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    eps = cfg.rms_norm_eps

    qkv = linear(x, w[prefix + "in_proj_qkv.weight"])  # [B, T, C]
    C = qkv.shape[-1]
    z = linear(x, w[prefix + "in_proj_z.weight"]).reshape(B, T, Hv, Dv)
    b = linear(x, w[prefix + "in_proj_b.weight"])  # [B, T, Hv]
    a = linear(x, w[prefix + "in_proj_a.weight"])
    beta = sigmoid(b)
    g = -np.exp(f64(w[prefix + "A_log"])) * softplus(a + f64(w[prefix + "dt_bias"]))

    # causal depthwise conv: out[t, c] = sum_j kernel[c, j] * in[t - (K-1) + j, c]
    if conv_state is None:
        conv_state = np.zeros((B, K - 1, C))
    seq = np.concatenate([f64(conv_state), qkv], axis=1)  # [B, K-1+T, C]
    kernel = f64(w[prefix + "conv1d.weight"])  # [C, K]
    assert kernel.shape == (C, K), kernel.shape
    conv = np.zeros((B, T, C))
    for t in range(T):
        conv[:, t] = np.sum(seq[:, t:t + K] * kernel.T[None], axis=1)
    conv = silu(conv)
    new_conv_state = seq[:, seq.shape[1] - (K - 1):]

    kd = Hk * Dk
    q = conv[..., :kd].reshape(B, T, Hk, Dk)
    k = conv[..., kd:2 * kd].reshape(B, T, Hk, Dk)
    v = conv[..., 2 * kd:].reshape(B, T, Hv, Dv)
    q = l2norm(q, 1e-6) * Dk ** -0.5
    k = l2norm(k, 1e-6)
    key_of = np.arange(Hv) // (Hv // Hk)  # value head j reads key head j // (Hv / Hk)
    q, k = q[:, :, key_of], k[:, :, key_of]  # [B, T, Hv, Dk]

    S = np.zeros((B, Hv, Dk, Dv)) if state is None else f64(state).copy()
    outs = np.zeros((B, T, Hv, Dv))
    for t in range(T):
        S = np.exp(g[:, t])[:, :, None, None] * S
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # [B, Hv, Dk], [B, Hv, Dv], [B, Hv, Dk]
        remembered = np.einsum("bhkv,bhk->bhv", S, kt)  # S^T k
        delta = beta[:, t][:, :, None] * (vt - remembered)
        S = S + np.einsum("bhk,bhv->bhkv", kt, delta)
        outs[:, t] = np.einsum("bhkv,bhk->bhv", S, qt)  # S^T q

    o = gated_rmsnorm(outs, z, w[prefix + "norm.weight"], eps).reshape(B, T, Hv * Dv)
    return linear(o, w[prefix + "out_proj.weight"]), new_conv_state, S


# ---- sparse mixture of experts -----------------------------------------------------------------------------------
def swiglu(x, gate_w, up_w, down_w):
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def route(router_logits, top_k, renormalise=True):
    """Softmax over all experts in float64, top-k, renormalised. Returns (indices [N, k], weights [N, k])."""
    p = softmax(router_logits, axis=-1)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(p, idx, axis=-1)
    if renormalise:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return idx, wts


def sparse_moe(w, prefix, x, cfg, routed=True):
    """routed = sum over top-k of w_e * down_e(silu(gate_e x) * up_e x); + sigmoid(shared_gate x) * shared(x)."""
    x = f64(x)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    out = sigmoid(linear(flat, w[prefix + "shared_expert_gate.weight"])) * swiglu(
        flat,
        w[prefix + "shared_expert.gate_proj.weight"],
        w[prefix + "shared_expert.up_proj.weight"],
        w[prefix + "shared_expert.down_proj.weight"],
    )
    if routed:
        idx, wts = route(linear(flat, w[prefix + "gate.weight"]), cfg.num_experts_per_tok,
                         getattr(cfg, "norm_topk_prob", True))
        G = f64(w[prefix + "experts.gate_proj.weight"])
        U = f64(w[prefix + "experts.up_proj.weight"])
        Dn = f64(w[prefix + "experts.down_proj.weight"])
        for n in range(flat.shape[0]):
            for e, we in zip(idx[n], wts[n]):
                out[n] += we * swiglu(flat[n:n + 1], G[e], U[e], Dn[e])[0]
    return out.reshape(shape)


def moe_routing(w, prefix, x, cfg):
    """The top-k expert choice and the probability margin between the k-th and (k+1)-th expert, per token."""
    flat = f64(x).reshape(-1, x.shape[-1])
    p = np.sort(softmax(linear(flat, w[prefix + "gate.weight"])), axis=-1)[:, ::-1]
    k = cfg.num_experts_per_tok
    margin = p[:, k - 1] - p[:, k] if k < p.shape[1] else np.full(p.shape[0], np.inf)
    return route(linear(flat, w[prefix + "gate.weight"]), k)[0], margin


# ---- decoder layer, trunk, MTP head --------------------------------------------------------------------------------
def decoder_layer(w, prefix, x, cfg, kind, cache=None, offset=0):
    """h = x + mixer(input_layernorm(x)); out = h + moe(post_attention_layernorm(h)).

    `cache` carries the mixer state between calls: for linear attention (conv_state, state), for full attention
    (keys, values) (with `offset` the position of x's first token). Returns (out, new cache).
    """
    eps = cfg.rms_norm_eps
    n = rmsnorm(x, w[prefix + "input_layernorm.weight"], eps)
    if kind == LINEAR:
        conv_state, state = cache if cache is not None else (None, None)
        m, conv_state, state = gated_deltanet(w, prefix + "linear_attn.", n, cfg, conv_state, state)
        new_cache = (conv_state, state)
    else:
        m, new_cache = gated_attention(w, prefix + "self_attn.", n, cfg, offset=offset, past=cache)
    h = f64(x) + m
    routed = (prefix + "mlp.experts.gate_proj.weight") in w
    return h + sparse_moe(w, prefix + "mlp.", rmsnorm(h, w[prefix + "post_attention_layernorm.weight"], eps), cfg,
                          routed=routed), new_cache


def layer_types(cfg):
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
    return types


def lm_head(w, h, cfg):
    if getattr(cfg, "tie_word_embeddings", False):
        return linear(h, w["embed_tokens.weight"])
    return linear(h, w["lm_head.weight"])


def trunk(w, tokens, cfg):
    """tokens [B, T] -> (pre-norm state, post-norm h, logits)."""
    x = f64(w["embed_tokens.weight"])[np.asarray(tokens)]
    for i, kind in enumerate(layer_types(cfg)):
        x, _ = decoder_layer(w, f"layers.{i}.", x, cfg, kind)
    h = rmsnorm(x, w["norm.weight"], cfg.rms_norm_eps)
    return x, h, lm_head(w, h, cfg)


def mtp_state(w, hidden, next_embedding, cfg, cache=None, offset=0):
    """The head's post-norm state for (h_t, embed(x_{t+1})) pairs at positions offset.. ; returns (state, cache)."""
    eps = cfg.rms_norm_eps
    e = rmsnorm(next_embedding, w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rmsnorm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    z = linear(np.concatenate([e, h], axis=-1), w["mtp.fc.weight"])  # embedding first
    z, cache = decoder_layer(w, "mtp.layers.0.", z, cfg, FULL, cache=cache, offset=offset)
    return rmsnorm(z, w["mtp.norm.weight"], eps), cache


def mtp_logits(w, tokens, cfg):
    """Teacher-forced head logits [B, T-1, V]: position t from h_t (post final norm) and x_{t+1}, predicts x_{t+2}."""
    tokens = np.asarray(tokens)
    _, h, _ = trunk(w, tokens, cfg)
    emb = f64(w["embed_tokens.weight"])[tokens[:, 1:]]
    state, _ = mtp_state(w, h[:, :-1], emb, cfg)
    return lm_head(w, state, cfg)
