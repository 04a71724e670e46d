"""remat.hf: one call enables remat on Hugging Face models built from tiny configs.

Every model is made from its configuration class with random weights (nothing is downloaded),
two layers of width 32, dropout on, and trained one step with and without remat from the same
random state: loss and every gradient must be bit-equal, and remat must hold fewer bytes for
backward.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import policies

tf = pytest.importorskip("transformers", reason="transformers is not installed")

MODELS = ("gpt2", "llama", "mistral", "bert", "t5", "vit")
VOCAB, SEQ, BATCH, WIDTH = 64, 8, 2, 32


def _config(name: str, attention: str) -> Any:
    common: dict[str, Any] = {"attn_implementation": attention}
    if name == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=4,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **common,
        )  # fmt: skip
    if name in ("llama", "mistral"):
        cls = tf.LlamaConfig if name == "llama" else tf.MistralConfig
        return cls(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attention_dropout=0.1, **common,
        )  # fmt: skip
    if name == "bert":
        return tf.BertConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1, **common,
        )  # fmt: skip
    if name == "t5":
        return tf.T5Config(
            vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.1, decoder_start_token_id=0, **common,
        )  # fmt: skip
    return tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=WIDTH, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, num_labels=3, **common,
    )  # fmt: skip


def _model(name: str, attention: str = "eager") -> nn.Module:
    classes = {
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "bert": tf.BertForMaskedLM,
        "t5": tf.T5ForConditionalGeneration,
        "vit": tf.ViTForImageClassification,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = classes[name](_config(name, attention))
    return model.train()


def _inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {
            "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 3, (BATCH,), generator=g),
        }
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": tokens, "labels": tokens}


def _step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
    """One training step from a fixed random state: the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        loss = model(**inputs).loss
        loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _plain(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
    """The plain step a model under ``remat.hf`` equals: without a key/value cache, which
    ``remat.hf`` drops in training as Hugging Face's own checkpointing does (with one,
    transformers >= 5.24 attends over the cache's copy of the keys and values, which can
    differ from the step without it in the last bits)."""
    takes = "use_cache" in inspect.signature(type(model).forward).parameters
    return _step(model, {**inputs, "use_cache": False} if takes else inputs)


def _held_for_backward(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """Bytes that a forward pass leaves alive for backward (live bytes after the loss)."""
    with remat.MemoryTracker(model, timeline=False) as tracker:
        loss = model(**inputs).loss
        held = tracker.live_bytes("cpu")
        loss.backward()
    return held


Step = tuple[torch.Tensor, list[Any]]


def _assert_exact(plain: Step, ours: Step) -> None:
    assert torch.equal(plain[0], ours[0])
    assert len(plain[1]) == len(ours[1])
    for a, b in zip(plain[1], ours[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_enable_is_exact_and_holds_less(name: str, attention: str) -> None:
    model, inputs = _model(name, attention), _inputs(name)
    plain, cached = _plain(model, inputs), _step(model, inputs)
    plain_held = _held_for_backward(model, inputs)

    remat.hf.enable(model)
    layers = [m for m in model.modules() if remat.hf.layer_classes(model)[0] is type(m)]
    assert len(layers) >= 2
    _assert_exact(plain, _step(model, inputs))
    held = _held_for_backward(model, inputs)
    assert held < plain_held, (held, plain_held)

    remat.hf.disable(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    _assert_exact(cached, _step(model, inputs))  # the cache is the model's again


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_enable_with_a_policy_is_exact(name: str) -> None:
    model, inputs = _model(name, "sdpa"), _inputs(name)
    plain = _plain(model, inputs)
    plain_held = _held_for_backward(model, inputs)
    remat.hf.enable(model, policies.save_matmuls)
    _assert_exact(plain, _step(model, inputs))
    assert _held_for_backward(model, inputs) < plain_held


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", ["GPT2Block"]),
        ("llama", ["LlamaDecoderLayer"]),
        ("mistral", ["MistralDecoderLayer"]),
        ("bert", ["BertLayer"]),  # BertEmbeddings is named too, but is not a repeated layer
        ("t5", ["T5Block"]),
        ("vit", ["ViTLayer"]),
    ],
)
def test_layer_classes_come_from_no_split_modules(name: str, expected: list[str]) -> None:
    assert [c.__name__ for c in remat.hf.layer_classes(_model(name))] == expected


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_region_given_a_cache_with_gradients_raises_in_forward(attention: str) -> None:
    """A layer appends to its cache, and a region's recompute would append again: with SDPA
    and no mask the gradients came out right and the caller's cache silently held every key
    twice; with eager attention backward raised. Now the region refuses the call in forward,
    before the layer appends anything; remat.hf.enable drops the cache instead."""
    model, inputs = _model("llama", attention), _inputs("llama")
    remat.apply(model, remat.hf.layer_classes(model))
    cache = tf.DynamicCache()
    name = (
        "cache"
        if "cache" in inspect.signature(type(model).forward).parameters
        else "past_key_values"
    )
    layer = type(model.model.layers[0]).__name__
    with pytest.raises(
        remat.RematError,
        match=rf"{layer} runs in a checkpointed region with a key/value cache \(use_cache=True, "
        r"\w+=DynamicCache\).* use_cache=False .*remat\.hf\.enable",
    ):
        model(**inputs, use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 0
    # the model's default, use_cache from its config, too
    assert model.config.use_cache
    with pytest.raises(remat.RematError, match="key/value cache"):
        model(**inputs)
    # without gradients nothing is recomputed, and the cache works
    with torch.no_grad():
        assert model(**inputs, use_cache=True).past_key_values.get_seq_length() == SEQ
    # remat.checkpoint given a layer (a module, not its bound forward) refuses it too
    with pytest.raises(remat.RematError, match=r"_Layer runs .* \(past_key_values=list\)"):
        remat.checkpoint(_Layer(), torch.ones(2, requires_grad=True), past_key_values=[])


class _Layer(nn.Module):
    def forward(self, x: torch.Tensor, past_key_values: list[Any] | None = None) -> torch.Tensor:
        if past_key_values is not None:
            past_key_values.append(x)
        return x.sin()


def test_cache_is_dropped_in_training_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # With the cache on, each layer would append to it again in the recompute (a region
    # refuses it); enable() drops it in training, as Hugging Face does.
    model, inputs = _model("llama"), _inputs("llama")
    plain = _step(model, {**inputs, "use_cache": False})
    remat.hf._warned.clear()
    remat.hf.enable(model)
    with caplog.at_level(logging.WARNING, logger="remat.hf"):
        _assert_exact(plain, _step(model, {**inputs, "use_cache": True}))
    layer = type(model.model.layers[0])
    cache = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"
    assert f"LlamaDecoderLayer runs with use_cache=False, {cache}=None" in caplog.text
    # in evaluation (generation) the cache passes through
    model.eval()
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    assert out.past_key_values.get_seq_length() == SEQ


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_cache_is_dropped_in_evaluation_with_gradients(attention: str) -> None:
    """Evaluation mode with gradients on (attribution, fine-tuning with dropout off): the
    layers still recompute, so the cache goes as in training. It once passed through: eager
    attention raised in backward, and SDPA appended the keys to the caller's cache twice."""
    model, inputs = _model("llama", attention).eval(), _inputs("llama")
    plain = _step(_model("llama", attention).eval(), {**inputs, "use_cache": False})
    remat.hf.enable(model)
    cache = tf.DynamicCache()
    name = (
        "cache"
        if "cache" in inspect.signature(type(model).forward).parameters
        else "past_key_values"
    )
    kwargs = {**inputs, "use_cache": True, name: cache}
    _assert_exact(plain, _step(model, kwargs))
    assert cache.get_seq_length() == 0  # nothing appended, once or twice


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_cache_holding_a_prefix_is_refused_in_training(name: str) -> None:
    """Prefix tuning passes trainable keys and values for each layer in the cache. Dropping
    that cache, as ``remat.hf`` drops an empty one, left the prefix out: the model attended
    to other keys (or failed on the mask's shape) and the prefix never trained. It raises,
    naming the fix; without gradients (generation) the cache passes through."""
    model, inputs = _model(name), _inputs(name)
    remat.hf.enable(model)
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    prefix = nn.Parameter(torch.randn(layers, 2, BATCH, heads, 3, width))

    def prefilled() -> Any:
        cache = tf.DynamicCache(config=config)
        for i in range(layers):
            cache.update(prefix[i, 0], prefix[i, 1], i)
        return cache

    argument = (
        "cache"
        if "cache" in inspect.signature(type(model).forward).parameters
        else "past_key_values"
    )
    ids = inputs["input_ids"]
    positions = torch.arange(SEQ).expand(BATCH, -1)  # within GPT-2's learned positions
    with pytest.raises(remat.RematError, match=r"holding keys and values for its layer already"):
        model(input_ids=ids, position_ids=positions, **{argument: prefilled()}, use_cache=False)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, **{argument: prefilled()}, use_cache=True)


def test_gpt2_positional_cache_is_dropped() -> None:
    # GPT2Model passes the cache to its blocks positionally.
    model, inputs = _model("gpt2"), _inputs("gpt2")
    plain = _step(model, {**inputs, "use_cache": False})
    remat.hf.enable(model)
    _assert_exact(plain, _step(model, {**inputs, "use_cache": True}))


def _hf_checkpointing(model: Any, on: bool) -> None:
    """Hugging Face's gradient checkpointing on or off, by the name the installed version
    documents (transformers 5 renamed it and warns on the old name)."""
    verb = "enable" if on else "disable"
    switch = getattr(model, f"activation_checkpointing_{verb}", None)
    (switch or getattr(model, f"gradient_checkpointing_{verb}"))()


def test_errors() -> None:
    model = _model("gpt2")
    with pytest.raises(remat.RematError, match="both policy= and budget="):
        remat.hf.enable(model, policies.save_matmuls, budget="50%")
    # a budget passed where the policy goes, and the planner's arguments without a budget,
    # were taken as a policy (an error naming remat.apply), and dropped
    with pytest.raises(
        remat.RematError,
        match=r"remat\.hf\.enable: policy must be .*got str \('50%'\)\. A budget goes by "
        r"keyword: remat\.hf\.enable\(model, budget='50%'\)",
    ):
        remat.hf.enable(model, "50%")  # type: ignore[arg-type]
    inputs = _inputs("gpt2")
    with pytest.raises(remat.RematError, match=r"got example_inputs= and loss_fn= without budget="):
        remat.hf.enable(model, example_inputs=inputs, loss_fn=lambda out: out.loss)
    with pytest.raises(remat.RematError, match=r"got loss_fn= without budget="):
        remat.hf.enable(model, loss_fn=lambda out: out.loss)
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(remat.RematError, match="no layer of GPT2LMHeadModel was enabled"):
        remat.hf.disable(model)
    remat.hf.enable(model)
    with pytest.raises(remat.RematError, match="already enabled"):
        remat.hf.enable(model)
    remat.hf.disable(model)
    with pytest.raises(remat.RematError, match="names no layer classes"):
        remat.hf.enable(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(remat.RematError, match=r"expected an nn\.Module, got str"):
        remat.hf.enable("gpt2")  # type: ignore[arg-type]
    # remat.apply's options do not go with a budget: the plan chooses (checked before planning)
    for option in ({"offload_to_cpu": True}, {"every": 2}):
        with pytest.raises(remat.RematError, match=r"with budget=, the options are remat\.fit's"):
            remat.hf.enable(model, budget="50%", example_inputs=_inputs("gpt2"), **option)


def test_the_plan_of_a_budget_is_found_from_the_model() -> None:
    """enable returns the model; the plan it set up, for its summary and report, is
    ``remat.Plan.of(model)``."""
    model = _model("gpt2")
    assert remat.hf.enable(model, budget="80%", example_inputs=_inputs("gpt2")) is model
    plan = remat.Plan.of(model)
    assert plan is not None and "predicted peak" in plan.summary()
    assert {b["path"] for b in plan.blocks} == {f"transformer.h.{i}" for i in range(2)}
    remat.hf.disable(model)
    assert remat.Plan.of(model) is None


def test_unapply_takes_enables_cache_hooks_off_too() -> None:
    """After remat.unapply, a model enabled by remat.hf keeps its key/value cache again, and
    can be enabled again."""
    model = _model("llama").eval()
    ids = _inputs("llama")["input_ids"]
    remat.hf.enable(model)
    remat.unapply(model)
    assert not [m for m in model.modules() if m._forward_pre_hooks]
    with torch.enable_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert cache is not None and cache.get_seq_length() == ids.shape[1]
    remat.hf.enable(model)
    remat.hf.disable(model)


def test_compiled_once_into_one_graph_with_the_configs_cache_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A default Llama config has use_cache=True: the layers' hook drops the cache in training
    without a graph break (no logging in traced code), and the model compiles once."""
    monkeypatch.setattr(remat.hf, "_warned", set())  # as in a process that has not warned yet
    model = _model("llama")
    assert model.config.use_cache
    remat.hf.enable(model)
    inputs = _inputs("llama")
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
        graphs.append(1)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(3):
        compiled(**inputs).loss.backward()
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_hugging_face_checkpointing_already_on_is_refused() -> None:
    """With Hugging Face's checkpointing on, remat.hf.enable, remat.apply and remat.plan each
    refuse: a region or plan around it would recompute every layer twice, and a profile would
    measure its recompute as the plain step (the planner then finds nothing to save and asks
    for a budget of 100%)."""
    model = _model("llama")
    _hf_checkpointing(model, on=True)
    # the call to make, by the name the installed transformers documents
    off = "activation" if hasattr(model, "activation_checkpointing_disable") else "gradient"
    with pytest.raises(remat.RematError, match=f"Call model.{off}_checkpointing_disable"):
        remat.hf.enable(model)
    with pytest.raises(remat.RematError, match=r"remat.apply: .* is on in LlamaForCausalLM"):
        remat.apply(model, remat.hf.layer_classes(model))
    loss_fn: Callable[[Any], Any] = lambda out: out.loss  # noqa: E731
    with pytest.raises(remat.RematError, match=rf"remat.plan: .*{off}_checkpointing_disable"):
        remat.fit(model, _inputs("llama"), budget="50%", loss_fn=loss_fn, repeats=0)
    assert not any(remat.modules.is_wrapped(m) for m in model.modules())
    _hf_checkpointing(model, on=False)
    remat.hf.enable(model)


@pytest.mark.parametrize("how", ["hf-region", "hf-policy", "hf-budget", "apply-policy", "fit"])
def test_hugging_face_checkpointing_turned_on_later_is_refused(how: str) -> None:
    """``gradient_checkpointing_enable()`` after remat was set up (``remat.hf.enable``,
    ``remat.apply``, ``remat.fit``) would wrap every layer in torch's checkpoint around remat's
    decisions: a policy that keeps every matmul, or a budget's plan, would silently become
    whole-layer recompute (more FLOPs, same gradients). The training forward refuses instead;
    evaluation still runs, turning Hugging Face's off again gives back remat's exact step, and
    undoing remat removes the check's hook."""
    # remat.fit alone profiles GPT-2's blocks with their key/value cache, which each run appends
    # to (NOTE [ Key/value caches in training ] in hf.py; remat.hf.enable drops it): BERT has
    # none.
    name = "bert" if how == "fit" else "gpt2"
    model, inputs = _model(name), _inputs(name)
    # remat.apply leaves the cache on: the graph engine replays ops, never the cache's update.
    plain = _step(model, inputs) if how == "apply-policy" else _plain(model, inputs)
    loss_fn: Callable[[Any], Any] = lambda out: out.loss  # noqa: E731
    if how == "hf-budget":
        remat.hf.enable(model, budget="70%", example_inputs=inputs, loss_fn=loss_fn, repeats=0)
    elif how == "apply-policy":
        remat.apply(model, remat.hf.layer_classes(model), policy=policies.save_matmuls)
    elif how == "fit":
        remat.fit(model, inputs, budget="75%", loss_fn=loss_fn, repeats=0)
    else:
        remat.hf.enable(model, policies.save_matmuls if how == "hf-policy" else None)
    _hf_checkpointing(model, on=True)
    with pytest.raises(remat.RematError, match=rf"turned on in {type(model).__name__} \("):
        _step(model, inputs)
    with torch.no_grad():
        model(**inputs)
    model.eval()
    model(**inputs)
    model.train()
    _hf_checkpointing(model, on=False)
    _assert_exact(plain, _step(model, inputs))
    if how.startswith("hf-"):
        remat.hf.disable(model)
    else:
        remat.unapply(model)
    assert not model._forward_pre_hooks


def test_a_budget_with_the_lower_layers_frozen_plans_the_layers_that_train() -> None:
    """Fine-tuning with the embeddings and the first layer frozen: that layer computes no
    gradient and saves nothing, so the plan leaves it out and plans the other; the step stays
    bit-equal (it used to fail: a block returned no tensor that requires grad)."""
    model, inputs = _model("llama"), _inputs("llama")
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    plain = _plain(model, inputs)
    remat.hf.enable(model, budget="90%", example_inputs=inputs, repeats=0)
    first, second = model.model.layers
    assert any(type(h).__name__ == "UnlikeProfiled" for h in second._forward_pre_hooks.values())
    assert not any(type(h).__name__ == "UnlikeProfiled" for h in first._forward_pre_hooks.values())
    _assert_exact(plain, _step(model, inputs))
    remat.hf.disable(model)


@pytest.mark.parametrize(("name", "budget"), [("gpt2", "70%"), ("llama", "60%")])
def test_a_budget_is_planned_exact_and_within_it(name: str, budget: str) -> None:
    """``budget=`` plans with remat.fit over the model's layers: the step stays bit-equal, it
    holds less for backward than the plain step, and disable undoes it."""
    model, inputs = _model(name), _inputs(name)
    plain, cached = _plain(model, inputs), _step(model, inputs)
    plain_held = _held_for_backward(model, inputs)
    with pytest.raises(remat.RematError, match="pass example_inputs="):
        remat.hf.enable(model, budget="50%")
    unlabelled = {k: v for k, v in inputs.items() if k != "labels"}
    with pytest.raises(remat.RematError, match="has no loss to plan the step with: pass labels"):
        remat.hf.enable(model, budget=budget, example_inputs=unlabelled, repeats=0)
    assert not any(m._forward_pre_hooks for m in model.modules())  # left as it was
    # A budget near the smallest: the plan sets policies up, not only regions. The loss is the
    # one the model computes from labels (``out.loss``), as in training.
    remat.hf.enable(model, budget=budget, example_inputs=inputs, repeats=0)
    layers = [m for m in model.modules() if remat.hf.layer_classes(model)[0] is type(m)]
    assert any(remat.modules.is_wrapped(m) for m in layers)
    _assert_exact(plain, _step(model, inputs))
    assert _held_for_backward(model, inputs) < plain_held
    remat.hf.disable(model)
    # Nothing of the plan is left: no wrapper, no policy or segment hooks, no offload scope.
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
    _assert_exact(cached, _step(model, inputs))


def test_a_budget_finds_the_shared_layer_of_a_model_that_names_none() -> None:
    """ALBERT names no layer classes (no ``_no_split_modules``) and calls one layer group (one
    layer) again and again: with ``budget=`` the planner finds the group, plans its calls one
    by one, and the step stays bit-equal. A model with neither named classes, a run of layers
    nor a shared layer is refused with the way out."""
    config = tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=WIDTH, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM(config).train()
    inputs = {**_inputs("bert"), "input_ids": torch.randint(0, VOCAB, (4, SEQ))}
    inputs["labels"] = inputs["input_ids"]
    with pytest.raises(remat.RematError, match="names no layer classes"):
        remat.hf.enable(model)  # a policy needs the layers named
    plain = _plain(model, inputs)
    remat.hf.enable(model, budget="60%", example_inputs=inputs, repeats=0)
    plan = remat.Plan.of(model)
    assert plan is not None
    [block] = plan.blocks
    assert block["type"].startswith("AlbertLayerGroup") and len(block["calls"]) == 4
    assert plan.measured["calls"] == {block["path"]: 4}
    assert plan.measured["verified_peak"] <= plan.budget
    layer = model.get_submodule(block["path"])
    assert any(h is remat.hf._drop_cache for h in layer._forward_pre_hooks.values())
    _assert_exact(plain, _step(model, inputs))
    remat.hf.disable(model)
    assert not any(m._forward_pre_hooks for m in model.modules())

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            return type("Out", (), {"loss": self.fc(x).sum()})()

    with pytest.raises(remat.RematError, match=r"names no layer classes in _no_split_modules, has"):
        remat.hf.enable(Flat(), budget="50%", example_inputs=(torch.randn(2, 4),))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_plan_refuses_a_key_value_cache(name: str) -> None:
    """remat.fit on a layer that trains with a key/value cache: each replay of the layer in the
    profile would append to the cache again (a size mismatch deep in attention); the planner
    refuses, naming the layer and the fix, and leaves the model as it was. Without the cache
    the plan is made and exact."""
    model, inputs = _model(name), _inputs(name)
    uncached_plain = _plain(model, inputs)
    plain = _step(model, inputs)  # its gradients stay in the model: "left as found" below
    loss_fn: Callable[[Any], Any] = lambda out: out.loss  # noqa: E731
    layer = "transformer.h.0" if name == "gpt2" else "model.layers.0"
    with pytest.raises(
        remat.RematError,
        match=rf"block '{layer}' \(\w+\) runs with a key/value cache \(.*use_cache=False",
    ):
        remat.fit(model, inputs, budget="75%", loss_fn=loss_fn, repeats=0)
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
    _assert_exact(plain, (plain[0], [p.grad for p in model.parameters()]))  # left as found
    _assert_exact(plain, _step(model, inputs))

    # In evaluation mode with gradients on, as in training (remat.hf.enable drops it there too).
    model.eval()
    with pytest.raises(remat.RematError, match=r"runs with a key/value cache .*use_cache=False"):
        remat.fit(model, inputs, budget="75%", loss_fn=loss_fn, repeats=0)
    model.train()
    for m in model.modules():  # a failed plan leaves nothing behind
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__

    uncached = {**inputs, "use_cache": False}
    remat.fit(model, uncached, budget="75%", loss_fn=loss_fn, repeats=0)
    assert any("forward" in m.__dict__ for m in model.modules())
    _assert_exact(uncached_plain, _step(model, uncached))


def test_layers_by_name_and_a_deep_copy() -> None:
    model, inputs = _model("gpt2"), _inputs("gpt2")
    plain = _plain(model, inputs)
    remat.hf.enable(model, layers=["transformer.h.1"])
    wrapped = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert wrapped == ["transformer.h.1"]
    copy_ = copy.deepcopy(model)
    # Without the cache, which layer 0 (not enabled) would use and layer 1 drops.
    _assert_exact(plain, _step(copy_, {**inputs, "use_cache": False}))
    remat.hf.disable(copy_)  # the copy carries its own regions and hooks
    assert not any("forward" in m.__dict__ for m in copy_.modules())
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == wrapped


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_plan_counts_the_mask_every_layer_gets_where_layers_hold_it(name: str) -> None:
    """Eager attention passes one float mask to every layer, which adds it to its scores and
    saves nothing of it: the plain step frees it as the model's forward returns, and a layer
    that recomputes holds it until backward (see [ Side inputs ] in ``planning/solve.py``).
    Counted once, each plan's peak is what one step of it measures, to the byte."""
    from remat.planning.planner import _smallest, measured_peak, profile_model, solve

    model, inputs = _model(name), {**_inputs(name), "use_cache": False}

    def loss_fn(out: Any) -> torch.Tensor:
        loss: torch.Tensor = out.loss
        return loss

    blocks = remat.hf.layer_classes(model)
    profiled = profile_model(model, inputs, loss_fn, blocks=blocks, repeats=0)
    assert profiled.side_bytes >= BATCH * SEQ * SEQ * 4  # the mask, at least
    smallest = _smallest(profiled.costs, profiled.chain)
    for budget in ("80%", smallest):
        plan = solve(profiled, budget)
        assert any(b["option"] != "plain" for b in plan.blocks)
        assert measured_peak(plan, model, inputs, loss_fn) == plan.predicted_peak, plan.summary()


def test_a_wrapped_model_shows_its_forward_signature_and_generates_the_same() -> None:
    """Hugging Face reads ``inspect.signature(model.forward)`` to choose arguments:
    ``generate`` builds ``position_ids`` from the attention mask only for a forward that takes
    them. A whole model under ``checkpoint_wrapper`` shows its class's signature, and greedy
    decoding of a left-padded batch gives the plain model's tokens."""
    config = _config("gpt2", "eager")
    config.n_positions, config.pad_token_id = 32, 0
    torch.manual_seed(0)
    plain = tf.GPT2LMHeadModel(config).eval()
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain))
    assert inspect.signature(wrapped.forward) == inspect.signature(plain.forward)
    tokens = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0  # left padding
    outs = [
        m.generate(tokens, attention_mask=mask, max_new_tokens=4, do_sample=False)  # type: ignore[operator]
        for m in (plain, wrapped)
    ]
    assert torch.equal(outs[0], outs[1])
