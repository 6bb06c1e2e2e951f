"""Tiny Hugging Face models in user-style wrappers (`tests.hf_models:NAME`), random init from a
config (nothing downloaded). Each wrapper holds the HF model as an attribute and its `forward`
returns `.logits`, as a user's own training script would.

GPT-2 ties its input embedding and its output head (`transformer.wte.weight` is
`lm_head.weight`); BERT and ViT take their inputs as keyword arguments (a dict from
`make_batch`); ResNet has BatchNorm buffers. torchvision cannot load beside a CPU-only torch
build here (its `_C` extension needs CUDA libraries), so the vision models are HF's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.planner.workload import Workload

VOCAB, SEQ, HIDDEN = 64, 8, 16


class LM(nn.Module):
    """A user's wrapper around a causal LM: token ids in, logits out."""
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids):
        return self.hf(input_ids=input_ids, use_cache=False).logits


class Classifier(nn.Module):
    """A user's wrapper around a classifier taking keyword inputs: logits out."""
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, **inputs):
        return self.hf(**inputs).logits


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens(batch_size: int, seed: int):
    g = torch.Generator().manual_seed(int(seed))
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def gpt2(layers: int = 2) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0)
    return Workload(model=LM(GPT2LMHeadModel(cfg)), make_batch=_tokens, loss_fn=_lm_loss)


def llama(layers: int = 2) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    return Workload(model=LM(LlamaForCausalLM(cfg)), make_batch=_tokens, loss_fn=_lm_loss)


def bert(layers: int = 2) -> Workload:
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=SEQ,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)

    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
        mask = torch.ones(batch_size, SEQ, dtype=torch.int64)
        mask[:, SEQ - 2:] = torch.randint(0, 2, (batch_size, 2), generator=g)   # some padding
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (batch_size,), generator=g)
    return Workload(model=Classifier(BertForSequenceClassification(cfg)), make_batch=make_batch,
                    loss_fn=F.cross_entropy)


def _images(size: int, classes: int, key: str | None):
    def make_batch(batch_size: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn(batch_size, 3, size, size, generator=g)
        y = torch.randint(0, classes, (batch_size,), generator=g)
        return ({key: x} if key else x), y
    return make_batch


class ImageModel(nn.Module):
    """A user's wrapper around an image classifier: pixels in (positional), logits out."""
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, pixel_values):
        return self.hf(pixel_values=pixel_values).logits


def resnet(depths: int = 1) -> Workload:
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[depths, depths],
                       layer_type="basic", num_labels=5)
    return Workload(model=ImageModel(ResNetForImageClassification(cfg)),
                    make_batch=_images(16, 5, None), loss_fn=F.cross_entropy, optimizer="sgd", lr=0.01)


def vit(layers: int = 2) -> Workload:
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=HIDDEN,
                    num_hidden_layers=layers, num_attention_heads=2, intermediate_size=32,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)
    return Workload(model=Classifier(ViTForImageClassification(cfg)),
                    make_batch=_images(16, 5, "pixel_values"), loss_fn=F.cross_entropy)
