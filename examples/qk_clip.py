"""QK-Clip (MuonClip): after each optimizer step, rescale the query and key rows of every attention
head whose largest logit passed the threshold. A tiny random Llama built from a config; a low
threshold so that the clip acts within a few steps.

    python examples/qk_clip.py
"""

import torch

import muonkit
from muonkit.integrations.transformers import model_from_config

CONFIG = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
    "attn_implementation": "sdpa",  # or "eager"; flash / flex attention cannot report the maximum
}  # fmt: skip


def main(steps: int = 5) -> None:
    torch.manual_seed(0)
    model = model_from_config(CONFIG, device="cpu")
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.1, adamw_lr=3e-3)
    clip = muonkit.QKClip(model, opt, threshold=0.2, alpha=0.5)  # hooks opt.step(); 100 is the usual threshold
    for step in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # QK-Clip runs right after
        opt.zero_grad()
        print(f"step {step}: largest logit {clip.last_max_logit:.3f}, heads clipped {clip.last_clipped_heads}")


if __name__ == "__main__":
    main()
