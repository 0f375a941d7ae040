#!/usr/bin/env python3
"""Checks a GGUF written by `rltune export` with llama.cpp's own reader, the PyPI `gguf` package.

    PYTHONPATH=target/gguf-py python3 tools/models/check_gguf_export.py \
        --gguf model.gguf --model MODEL_DIR --type f16

MODEL_DIR is what was exported (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json; no adapter). The checks, against what llama.cpp's convert_hf_to_gguf.py
writes for `llama` and `qwen2`:
- GGUF v3, alignment 32, general.architecture / file_type / quantization_version;
- the <arch>.* hyperparameters from config.json (vocab_size and rope.dimension_count for llama);
- the tokenizer: model "gpt2", tokens by id, token types, merges, EOS id, chat template;
- tensor names, ggml shapes (transformers' reversed) and types (norms, biases and 1-D tensors F32);
- values: F32 equal bit for bit to the safetensors (Llama's q/k rows permuted as
  `LlamaModel.permute`), F16 equal to numpy's float16 rounding, Q8_0 bytes equal to
  `gguf.quants.quantize` (gguf-py's port of ggml's reference quantizer).
Prints one summary line; exits 1 listing every mismatch.
"""

import argparse
import importlib.metadata
import json
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}
MODULES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def load_safetensors(path):
    """{name: float32 array} of a safetensors file (F32, F16, BF16), without the safetensors package."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = data[a:b]
        if info["dtype"] == "F32":
            x = np.frombuffer(buf, np.float32)
        elif info["dtype"] == "F16":
            x = np.frombuffer(buf, np.float16).astype(np.float32)
        elif info["dtype"] == "BF16":
            x = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: tensor {name} has dtype {info['dtype']}; only F32/F16/BF16 are compared")
        out[name] = x.reshape(info["shape"])
    return out


def gguf_name(hf):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    module, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{MODULES[module]}.{kind}" if module in MODULES else None


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_type(name, shape, want):
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    if want == "q8_0":
        return Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16
    return {"f32": Q.F32, "f16": Q.F16}[want]


class Checker:
    def __init__(self):
        self.errors, self.checked = [], 0

    def eq(self, what, got, want):
        self.checked += 1
        if got != want:
            self.errors.append(f"{what}: got {got!r}, want {want!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--type", required=True, choices=sorted(FILE_TYPES))
    args = ap.parse_args()
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    tok = json.loads((model / "tokenizer.json").read_text())
    tc_path = model / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    r = gguf.GGUFReader(args.gguf)
    c = Checker()

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    arch = "qwen2" if cfg["model_type"] == "qwen2" else "llama"
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    c.eq("GGUF.version", field("GGUF.version"), 3)
    c.eq("alignment", r.alignment, 32)
    c.eq("general.architecture", field("general.architecture"), arch)
    c.eq("general.file_type", field("general.file_type"), FILE_TYPES[args.type])
    c.eq("general.quantization_version", field("general.quantization_version"), 2)
    hyper = {
        "block_count": cfg["num_hidden_layers"], "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
        "attention.head_count_kv": kv_heads, "context_length": cfg["max_position_embeddings"],
        "attention.layer_norm_rms_epsilon": float(np.float32(cfg["rms_norm_eps"])),
        "rope.freq_base": float(np.float32(cfg.get("rope_theta", 10000.0))),
    }
    if arch == "llama":
        hyper["vocab_size"] = cfg["vocab_size"]
        hyper["rope.dimension_count"] = cfg.get("head_dim") or cfg["hidden_size"] // heads
    for k, v in hyper.items():
        c.eq(f"{arch}.{k}", field(f"{arch}.{k}"), v)
    c.eq(f"{arch}.vocab_size present", f"{arch}.vocab_size" in r.fields, arch == "llama")

    # Tokenizer: by id, as convert_hf_to_gguf.py's get_vocab_base and SpecialVocab.
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: 1 for i in by_id}
    for a in tok.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
        types[a["id"]] = 3 if a.get("special") else 4
    n = cfg["vocab_size"]
    c.eq("tokenizer.ggml.model", field("tokenizer.ggml.model"), "gpt2")
    c.eq("tokenizer.ggml.tokens", field("tokenizer.ggml.tokens"), [by_id.get(i, f"[PAD{i}]") for i in range(n)])
    c.eq("tokenizer.ggml.token_type", field("tokenizer.ggml.token_type"), [types.get(i, 5) for i in range(n)])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    c.eq("tokenizer.ggml.merges", field("tokenizer.ggml.merges"), merges)
    ids = {t: i for i, t in by_id.items()}
    if isinstance(tc.get("eos_token"), str):
        c.eq("tokenizer.ggml.eos_token_id", field("tokenizer.ggml.eos_token_id"), ids[tc["eos_token"]])
    c.eq("tokenizer.chat_template", field("tokenizer.chat_template"), tc.get("chat_template"))

    # Tensors.
    weights = load_safetensors(model / "model.safetensors")
    want = {}
    for hf, w in weights.items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name = gguf_name(hf)
        if name is None:
            continue
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = permute(w, heads if ".attn_q." in name else kv_heads)
        want[name] = np.ascontiguousarray(w, dtype=np.float32)
    got = {t.name: t for t in r.tensors}
    c.eq("tensor names", sorted(got), sorted(want))
    counts, worst = {}, 0.0
    for name in sorted(set(got) & set(want)):
        t, w = got[name], want[name]
        ty = expected_type(name, w.shape, args.type)
        c.eq(f"{name} type", t.tensor_type, ty)
        c.eq(f"{name} shape", [int(x) for x in t.shape], list(reversed(w.shape)))
        c.eq(f"{name} offset % 32", t.data_offset % 32, 0)
        counts[ty.name] = counts.get(ty.name, 0) + 1
        if t.tensor_type != ty:
            continue
        ref = gguf.quants.quantize(w, ty)
        c.eq(f"{name} bytes equal gguf-py's {ty.name}", np.asarray(t.data).tobytes() == ref.tobytes(), True)
        back = gguf.quants.dequantize(np.asarray(t.data), ty).reshape(w.shape)
        worst = max(worst, float(np.abs(back - w).max()))

    if c.errors:
        print(f"FAILED: {len(c.errors)} of {c.checked} checks on {args.gguf}:")
        for e in c.errors:
            print("  " + e)
        sys.exit(1)
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    print(f"ok: gguf {importlib.metadata.version('gguf')} read {args.gguf}: "
          f"{c.checked} checks passed ({len(got)} tensors: {kinds}); "
          f"max |dequantized - original| {worst:.3e}")


if __name__ == "__main__":
    main()
