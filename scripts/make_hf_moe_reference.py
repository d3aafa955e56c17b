"""Produce tests/data/hf_moe/<name>/{config.json, model.safetensors, reference.npz}: tiny random MoE / MLA models
saved by Hugging Face transformers and transformers' own logits on fixed tokens.

Run with the Python 3.11 reference env (torch 2.13.0 CPU + transformers + accelerate):
    /tmp/refenv/bin/python scripts/make_hf_moe_reference.py
Models (hidden 64, a few layers, 8 experts):
  mixtral            softmax top-2 router (always renormalised), GQA 4/2 heads
  qwen3_moe          softmax top-3, norm_topk_prob False, q/k norms
  deepseek_v3        MLA (q_lora 48, kv_lora 32, nope 16, rope 8, v 16), sigmoid router with correction bias,
                     group-limited routing (4 groups, top-2 groups), 1 shared expert, first layer dense,
                     routed_scaling_factor 2.5, yarn rope (factor 4, mscale 1, mscale_all_dim 0.8)
  deepseek_v3_nolora MLA without q_lora, no groups, 2 shared experts, norm_topk_prob False, plain rope
  deepseek_v3_fp8    deepseek_v3 with every decoder Linear weight (not the router) quantized by transformers'
                     own Fp8Quantize to float8_e4m3fn with 16x16 `weight_scale_inv` blocks where the shape tiles
                     (others stay bf16, as transformers does); the reference is transformers loading it with
                     FineGrainedFP8Config(dequantize=True), i.e. transformers' own dequantization.
Weights are random (std 0.08, routers 0.5, correction bias 0.05, norms 1 + 0.1 N(0,1)), rounded to bf16 and saved
as bf16; logits come from the float64 model (the float32 model must agree to 1e-4, which also guards against
routing near-ties that would make the reference fragile). tokens: [2, 12] int32; logits: [2, 12, vocab] float32.
"""
import json
import os
import types

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, FineGrainedFP8Config, MixtralConfig,
                          MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.integrations.finegrained_fp8 import Fp8Quantize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "hf_moe")
B, S, V = 2, 12, 128

COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
DS = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
          n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
          first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32,
          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                           "mscale": 1.0, "mscale_all_dim": 0.8})
MODELS = {
    "mixtral": (MixtralForCausalLM, MixtralConfig(**COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                                  num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                      intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                      num_experts_per_tok=3, norm_topk_prob=False,
                                                      decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(**DS)),
    "deepseek_v3_nolora": (DeepseekV3ForCausalLM, DeepseekV3Config(**dict(
        DS, num_hidden_layers=2, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
        norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))),
}
# transformers v5 always uses sigmoid + correction bias for deepseek_v3 and does not write these fields;
# real DeepSeek-V3 / Kimi-K2 config.json files carry them.
DS_EXTRA = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
        for p in list(model.parameters()) + [b for n, b in model.named_buffers() if "correction" in n]:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))      # bf16-representable, saved exactly as bf16


def logits_of(model, tokens, dtype):
    model = model.to(dtype)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.to(torch.float64).numpy()


def patch_config(d, extra):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(extra)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, sort_keys=True)


def save_ref(d, tokens, ref, name):
    np.savez_compressed(os.path.join(d, "reference.npz"), tokens=tokens.astype(np.int32), logits=ref.astype(np.float32))
    print(f"{name}: {sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 1e3:.0f} kB")


def main():
    rng = np.random.default_rng(7)
    tokens = rng.integers(2, V, size=(B, S))
    for i, (name, (cls, cfg)) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = cls(cfg).eval()
        model.config._experts_implementation = "eager"       # the per-expert loop (grouped_mm has no float64)
        model.config._attn_implementation = "eager"
        randomize(model, 100 + i)
        ref = logits_of(model, tokens, torch.float64)
        f32 = logits_of(model, tokens, torch.float32)
        err = np.abs(ref - f32).max()
        assert err < 1e-4, f"{name}: float32 vs float64 logits differ by {err} (routing near a tie?)"
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(d)
        if name.startswith("deepseek"):
            patch_config(d, DS_EXTRA)
        if name == "qwen3_moe":    # transformers v5 writes num_local_experts; Qwen's own config.json has num_experts
            patch_config(d, {"num_experts": cfg.num_local_experts})
        save_ref(d, tokens, ref, name)
        print(f"  f32 vs f64 max |diff| {err:.2e}, logits std {ref.std():.3f}")
        if name == "deepseek_v3":
            make_fp8(d, tokens)


def make_fp8(src, tokens):
    d = os.path.join(OUT, "deepseek_v3_fp8")
    os.makedirs(d, exist_ok=True)
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    quantizer = types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[16, 16]))
    op = Fp8Quantize(quantizer)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out, n_fp8 = {}, 0
    for k, v in sd.items():
        if k.startswith("model.layers.") and v.ndim == 2 and not k.endswith("mlp.gate.weight"):
            r = op._quantize_one(k, v.to(torch.float32))
            n_fp8 += any(t.dtype == torch.float8_e4m3fn for t in r.values())
            out.update({kk: vv.contiguous() for kk, vv in r.items()})
        else:
            out[k] = v
    save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, sort_keys=True)
    model = DeepseekV3ForCausalLM.from_pretrained(
        d, quantization_config=FineGrainedFP8Config(weight_block_size=[16, 16], dequantize=True),
        dtype=torch.float32, experts_implementation="eager", attn_implementation="eager").eval()
    ref = logits_of(model, tokens, torch.float64)
    save_ref(d, tokens, ref, f"deepseek_v3_fp8 ({n_fp8} fp8 weights)")


if __name__ == "__main__":
    main()
