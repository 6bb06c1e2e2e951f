"""Models we did not write, for the accuracy benchmark: tiny Hugging Face transformers configs,
random init (nothing is downloaded). `--model benchmarks.hf_models:llama` etc.; needs
`transformers` (a benchmark extra, not a dependency of hetplan)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hetplan.planner.workload import Workload


def llama(layers: int = 4, d_model: int = 64, heads: int = 4, vocab: int = 512,
          context: int = 32) -> Workload:
    """LlamaForCausalLM (untied embeddings); next-token cross-entropy on random tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=context,
                      use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)

    def make_batch(batch: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(out, target):
        logits = _logits(out)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return Workload(model=model, make_batch=make_batch, loss_fn=loss_fn)


def resnet(width: int = 16, image: int = 32, classes: int = 10) -> Workload:
    """ResNetForImageClassification (four one-block stages, BatchNorm); cross-entropy on random
    images and labels."""
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=3, embedding_size=width,
                       hidden_sizes=[width, 2 * width, 4 * width, 8 * width], depths=[1, 1, 1, 1],
                       num_labels=classes)
    model = ResNetForImageClassification(cfg)

    def make_batch(batch: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 3, image, image, generator=g),
                torch.randint(0, classes, (batch,), generator=g))

    def loss_fn(out, target):
        return F.cross_entropy(_logits(out), target)
    return Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, optimizer="sgd", lr=0.01)


def _logits(out) -> torch.Tensor:
    """The logits of a Hugging Face output: a ModelOutput, or the dict a pipeline's last stage
    rebuilds it as."""
    if isinstance(out, dict):
        return out["logits"]
    return getattr(out, "logits", out)
