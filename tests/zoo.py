"""Models no one here wrote: tiny Hugging Face configs (random init, dropout 0, nothing
downloaded) and torch's own transformer layer, each with a batch and a loss, for the
conformance tests (tests/test_zoo.py) and the random-plan benchmark
(benchmarks/random_plans.py).

Each entry covers a way real models break planners: tied embeddings (GPT-2, BERT, T5,
Qwen2, BART), one layer's weights used by every block (ALBERT), rotary buffers, RMSNorm
and grouped-query attention (Llama, Qwen2), a padding mask passed by keyword (GPT-2 with
`attention_mask=`), a sliding-window mask (Mistral), an in-place
add into a module's output (Falcon), an RMSNorm inlined into ops (Gemma), a layer
computed and never used (SqueezeBERT's pooler), a mixture of
experts (Mixtral), bare parameters (ViT's cls_token and position table, ConvNeXt's layer
scale), a module traced with no input (BART's learned positions), rows folded into
the next dim (OPT's rows x tokens, BLOOM's rows x heads beside per-head slopes as many as
the rows, Swin's rows x windows), encoder-decoders (T5, BART, Pegasus: its
positions called with a tuple first), LayerNorm and BatchNorm CNNs (ConvNeXt, ResNet),
and a model torch.fx traces (torch's TransformerEncoderLayer). torchvision's classifiers
(in-place activations, two outputs) are tests/torchvision_zoo.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, ROWS, CLASSES, IMAGE = 64, 8, 4, 8, 16


@dataclass(frozen=True)
class ZooModel:
    """A model to plan and run: `make()` builds it seeded (the same weights every call),
    `batch(step)` is that step's global batch (inputs..., keyword inputs..., target),
    `loss(output, target)` a mean over rows."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable
    inputs: int = 1  # how many of batch()'s leading entries are positional model inputs
    keywords: tuple[str, ...] = ()  # the names of the keyword inputs after them

    def split(self, batch: tuple) -> tuple[tuple, dict]:
        """(positional inputs + targets, keyword inputs) of one of its batches."""
        n, k = self.inputs, len(self.keywords)
        return batch[:n] + batch[n + k:], dict(zip(self.keywords, batch[n:n + k]))

    def example(self) -> tuple[tuple, dict]:
        """(example_inputs, example_kwargs) to plan it with: step 0's inputs."""
        batch, kwargs = self.split(self.batch(0))
        return batch[:self.inputs], kwargs


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make():
        torch.manual_seed(0)
        return build()
    return make


def _tokens(step: int, vocab: int = VOCAB) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    return ids, torch.randint(0, vocab, (ROWS, SEQ), generator=g)


def _padded(step: int) -> tuple:
    """Token ids, an attention mask with two rows padded on the right, targets."""
    ids, targets = _tokens(step)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    mask[3, -2:] = 0
    return ids, mask, targets


def _seq2seq(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    decoder_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    # T5's forward takes (input_ids, attention_mask, decoder_input_ids) by position
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    return ids, mask, decoder_ids, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _images(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g),
            torch.randint(0, CLASSES, (ROWS,), generator=g))


def _features(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, SEQ, 32, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def token_loss(output, target):
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def class_loss(output, target):
    return F.cross_entropy(getattr(output, "logits", output).float(), target)


def _hf(config_name: str, model_name: str, **config):
    """A transformers model class built from its config class, dropout off."""
    def build():
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                    "embd_pdrop", "attn_pdrop", "dropout_rate", "attention_dropout",
                    "dropout", "activation_dropout",
                    "classifier_dropout_prob", "drop_path_rate", "router_jitter_noise"):
            if hasattr(cfg, key):
                setattr(cfg, key, 0.0)
        cfg.use_cache = False
        return getattr(transformers, model_name)(cfg).train()
    return build


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)

# BART's and Pegasus's layout: one encoder and one decoder layer
_ENCODER_DECODER = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=SEQ * 2, pad_token_id=0, eos_token_id=0,
                        decoder_start_token_id=0)


class TorchEncoderClassifier(nn.Module):
    """torch's own TransformerEncoderLayer (fx keeps it whole), a learned position table (a
    bare parameter) and a head: the plain-torch entry, traced by torch.fx."""

    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(torch.randn(1, SEQ, 32) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.encoder(x + self.position)).mean(1))


ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("gpt2", _seeded(_hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32,
                                 n_head=4, vocab_size=VOCAB, n_positions=SEQ * 2,
                                 bos_token_id=0, eos_token_id=0)),
             _tokens, token_loss),
    ZooModel("llama", _seeded(_hf("LlamaConfig", "LlamaForCausalLM", **_DECODER)),
             _tokens, token_loss),
    # a padding mask by keyword (GPT-2's second positional argument is the cache)
    ZooModel("gpt2_padded", _seeded(_hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32,
                                        n_head=4, vocab_size=VOCAB, n_positions=SEQ * 2,
                                        bos_token_id=0, eos_token_id=0)),
             _padded, token_loss, keywords=("attention_mask",)),
    ZooModel("qwen2", _seeded(_hf("Qwen2Config", "Qwen2ForCausalLM", tie_word_embeddings=True,
                                  **_DECODER)),
             _tokens, token_loss),
    # a sliding-window mask: a scalar `new_ones` read from a mask split by rows
    ZooModel("mistral", _seeded(_hf("MistralConfig", "MistralForCausalLM", sliding_window=4,
                                    **_DECODER)),
             _tokens, token_loss),
    # RMSNorm inlined into ops (`1 + weight`): bare parameters meeting rows through ops
    ZooModel("gemma", _seeded(_hf("GemmaConfig", "GemmaForCausalLM", head_dim=8, **_DECODER)),
             _tokens, token_loss),
    # adds in place into a module's output (`mlp_output += attention_output`)
    ZooModel("falcon", _seeded(_hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB,
                                   hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   new_decoder_architecture=False, multi_query=True,
                                   bos_token_id=0, eos_token_id=0)),
             _tokens, token_loss),
    ZooModel("mixtral", _seeded(_hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                    num_experts_per_tok=2, **_DECODER)),
             _tokens, token_loss),
    ZooModel("bert", _seeded(_hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB,
                                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=SEQ * 2)),
             _tokens, token_loss),
    # a pooler computed under the masked-LM head and never used: no gradient reaches it
    ZooModel("squeezebert", _seeded(_hf("SqueezeBertConfig", "SqueezeBertForMaskedLM",
                                        vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=SEQ * 2,
                                        q_groups=2, k_groups=2, v_groups=2,
                                        post_attention_groups=2, intermediate_groups=2,
                                        output_groups=2)),
             _tokens, token_loss),
    ZooModel("albert", _seeded(_hf("AlbertConfig", "AlbertForMaskedLM", vocab_size=VOCAB,
                                   embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=SEQ * 2)),
             _tokens, token_loss),
    ZooModel("t5", _seeded(_hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB,
                               d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                               decoder_start_token_id=0, pad_token_id=0)),
             _seq2seq, token_loss, inputs=3),
    # learned positions: a module traced with no input (an arange as long as its ids)
    ZooModel("bart", _seeded(_hf("BartConfig", "BartForConditionalGeneration",
                                 bos_token_id=0, **_ENCODER_DECODER)),
             _seq2seq, token_loss, inputs=3),
    # sinusoidal positions called with a tuple first, the traced tensor as a keyword
    ZooModel("pegasus", _seeded(_hf("PegasusConfig", "PegasusForConditionalGeneration",
                                    **_ENCODER_DECODER)),
             _seq2seq, token_loss, inputs=3),
    # flattens rows and tokens into one dim ([batch * seq, hidden]) between ops
    ZooModel("opt", _seeded(_hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=SEQ * 2, word_embed_proj_dim=32,
                                pad_token_id=0, bos_token_id=0, eos_token_id=0)),
             _tokens, token_loss),
    # ALiBi: per-head slopes (4 heads: as many as the batch's rows) tiled by the batch,
    # attention over batch x heads folded into one dim
    ZooModel("bloom", _seeded(_hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB,
                                  hidden_size=32, n_layer=2, n_head=4, pad_token_id=0,
                                  bos_token_id=0, eos_token_id=0)),
             _tokens, token_loss),
    ZooModel("vit", _seeded(_hf("ViTConfig", "ViTForImageClassification", image_size=IMAGE,
                                patch_size=4, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                num_labels=CLASSES)),
             _images, class_loss),
    ZooModel("convnext", _seeded(_hf("ConvNextConfig", "ConvNextForImageClassification",
                                     num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                     num_labels=CLASSES, image_size=IMAGE)),
             _images, class_loss),
    # windows: batch x windows folded into one dim, and back
    ZooModel("swin", _seeded(_hf("SwinConfig", "SwinForImageClassification", image_size=IMAGE,
                                 patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2],
                                 window_size=4, num_labels=CLASSES)),
             _images, class_loss),
    ZooModel("resnet", _seeded(_hf("ResNetConfig", "ResNetForImageClassification",
                                   num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                   depths=[1, 1], layer_type="basic", num_labels=CLASSES)),
             _images, class_loss),
    ZooModel("torch_encoder", _seeded(TorchEncoderClassifier), _features, class_loss),
]}


def train(model: nn.Module, entry: ZooModel, step_fn, steps: int = 3, lr: float = 0.05):
    """`steps` SGD steps; `step_fn(model, batch, loss_fn, optimizer, kwargs)` runs one
    (`batch`: inputs and target, `kwargs`: the keyword inputs, both whole)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    for step in range(steps):
        batch, kwargs = entry.split(entry.batch(step))
        step_fn(model, batch, lambda out, y: entry.loss(out, y), opt, kwargs)
    return model


def single_process_step(model, batch, loss_fn, opt, kwargs):
    *inputs, target = batch
    opt.zero_grad()
    loss_fn(model(*inputs, **kwargs), target).backward()
    opt.step()


def reference(entry: ZooModel, steps: int = 3) -> dict[str, torch.Tensor]:
    """Parameters after `steps` steps in one process on the whole batch."""
    model = train(entry.make(), entry, single_process_step, steps)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_once(entry: ZooModel, steps: int = 3) -> dict[str, torch.Tensor]:
    """`reference(entry, steps)`, trained once per process and shared, read-only, by
    every check of the model (tests/test_zoo.py compares its 5 plan kinds, random plans
    and 4-rank plans with it; tests/test_experts.py its 6 kinds, ep 2 x dp 2, random and
    3-D plans; tests/test_hf_pipeline.py each plan of a model): the same deterministic
    steps each time, 1-3 s a model in a process that has traced models (tests/test_zoo.py
    took 554 s alone with one per test, 370 s with this). Kept per ROWS, which a test may
    change (tests/test_small_batch_plans.py). For the zoos' tiny models only:
    torchvision's float64 references are hundreds of MB."""
    return _reference_of(entry, ROWS, steps)


@cache
def _reference_of(entry: ZooModel, rows: int, steps: int) -> dict[str, torch.Tensor]:
    return reference(entry, steps)


@cache
def canonical_names(entry: ZooModel) -> dict[str, str]:
    """Every name a parameter of the model goes by -> the one `reference` keys it by: a
    pipeline's last stage names a tied head's copy "lm_head.weight", the model
    "transformer.wte.weight". Once per model and process (read-only)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n)
            for n, p in skeleton(entry).named_parameters(remove_duplicate=False)}


def skeleton(entry: ZooModel) -> nn.Module:
    """The model for its parameters' names and shapes: built on the meta device (no
    memory: VGG-11's are 1 GB in float64) once per process, as a zoo launch's rank reads
    it for every plan of the model (2 builds a job, ~0.05 s each for a small Hugging Face
    model), or plainly where it cannot be (RegNet computes its widths with tensors, which
    meta cannot hand back)."""
    try:
        return _meta_skeleton(entry)
    except NotImplementedError:
        return entry.make()


@cache
def _meta_skeleton(entry: ZooModel) -> nn.Module:
    with torch.device("meta"):
        return entry.make()


# what a plan says only to its reader: predictions, the solver's and the search's records,
# the reasons for its choices; the executor reads none of them (executor.monitor compares
# predictions with a run, after it)
_REPORTS = frozenset({"predicted", "solver", "search", "mesh_choice", "standard_choice"})


def run_key(plan_json: str) -> str:
    """`plan_json` less what only reports (its predictions, per layer its reason and
    costs): two plans with one key train the same steps, so a conformance launch runs
    one of them (a model's optimum is often its DDP plan on 2 ranks)."""
    import json

    plan = {k: v for k, v in json.loads(plan_json).items() if k not in _REPORTS}
    plan["layers"] = [{k: v for k, v in layer.items()
                       if k != "reason" and not k.endswith(("_s", "_bytes"))}
                      for layer in plan["layers"]]
    return json.dumps(plan, sort_keys=True)


def run_once(jobs: list) -> tuple[list, dict]:
    """(`jobs` (model, label, plan JSON) with one of each model's jobs of one `run_key`,
    {a job left out: the (model, label) whose run stands for it})."""
    first: dict[tuple, tuple] = {}
    kept, same = [], {}
    for name, label, plan_json in jobs:
        twin = first.setdefault((name, run_key(plan_json)), (name, label))
        if twin == (name, label):
            kept.append((name, label, plan_json))
        else:
            same[(name, label)] = twin
    return kept, same
