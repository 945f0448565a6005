"""`attn_implementation="attnkit"` in transformers: the same logits and gradients as
`eager`, with the mask's structure kept (tiny random-weight models built from configs)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit as ak  # noqa: E402
import attnkit.integrations.transformers as akt  # noqa: E402
import attnkit.integrations.transformers_mask as akt_mask  # noqa: E402
from attnkit.masks.structure import is_sdpa_causal  # noqa: E402

akt.register()

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**TINY, sliding_window=4)
        )
    elif kind == "gemma2":
        config = transformers.Gemma2Config(
            **TINY,
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            query_pre_attn_scalar=16,
        )
        model = transformers.Gemma2ForCausalLM(config)
    else:
        config = transformers.GptOssConfig(
            **TINY,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        )
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)  # sinks that matter
    return model.eval()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model, impl: str, **inputs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_logits_equal_eager_on_plain_and_padded_batches(kind):
    model = _model(kind)
    batch = _batch()
    for inputs in ({"input_ids": batch["input_ids"]}, batch):
        want, got = _logits(model, "eager", **inputs), _logits(model, "attnkit", **inputs)
        real = inputs.get("attention_mask", torch.ones(3, 11)).bool()  # padding rows differ
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_equals_eager(kind, cache):
    model = _model(kind)
    batch = _batch()
    outs = []
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        outs.append(
            model.generate(
                **batch,
                max_new_tokens=6,
                do_sample=False,
                cache_implementation=cache,
                pad_token_id=0,
            )
        )
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_documents_are_kept_apart_and_recognised(kind, monkeypatch):
    model = _model(kind)
    ids = _batch()["input_ids"][:1]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]])
    seen = []
    real = akt.attention_forward

    def spy(module, q, k, v, mask, **kwargs):
        seen.append(str(mask))
        return real(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "attnkit", spy)
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    want, got = _logits(model, "eager", **inputs), _logits(model, "attnkit", **inputs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert seen and all("document" in s for s in seen), seen
    assert all(("sliding_window(left=3" in s) == (kind == "mistral") for s in seen), seen


def test_training_gradients_equal_sdpa():
    """Against sdpa, not eager: the left-padded rows see no key, and their output (0 here
    and in sdpa, eager's average of all values) predicts the first real token's label."""
    model = _model("mistral").train()
    batch = _batch()
    grads = []
    for impl in ("sdpa", "attnkit"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(
            **batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        ).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_custom_4d_mask_is_exact():
    model = _model("llama")
    ids = _batch()["input_ids"][:1, :6]
    visible = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [1, 0, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1],
        ]
    ).bool()[None, None]
    additive = torch.zeros(1, 1, 6, 6).masked_fill(~visible, torch.finfo(torch.float32).min)
    for mask in (visible, additive):
        inputs = {"input_ids": ids, "attention_mask": mask}
        torch.testing.assert_close(
            _logits(model, "attnkit", **inputs),
            _logits(model, "sdpa", **inputs),  # eager adds a bool mask as 0/1
            atol=2e-5,
            rtol=1e-4,
        )


def test_config_and_from_pretrained_take_the_name(tmp_path):
    config = transformers.LlamaConfig(**TINY, attn_implementation="attnkit")
    model = transformers.LlamaForCausalLM(config)
    assert model.config._attn_implementation == "attnkit"
    model.save_pretrained(tmp_path)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="attnkit")
    assert again.config._attn_implementation == "attnkit"


def test_output_attentions_gives_the_exact_weights():
    model = _model("llama")
    batch = _batch()
    model.set_attn_implementation("attnkit")
    with torch.no_grad():
        got = model(**batch, output_attentions=True).attentions
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(**batch, output_attentions=True).attentions
    real = batch["attention_mask"].bool()[:, None, :, None]  # rows of real queries
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g * real, w * real, atol=1e-6, rtol=1e-5)


def test_register_is_idempotent_and_refuses_special_names():
    assert akt.register() == "attnkit" and akt.register() == "attnkit"
    for name in ("sdpa", "eager", "flash_attention_2", "paged|attnkit", "org/kernel", ""):
        with pytest.raises(ValueError, match=r"transformers treats|plain identifier"):
            akt.register(name)
    transformers.AttentionInterface.register("taken_by_other", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        akt.register("taken_by_other")


def _causal_fn(b, h, q, kv):
    return kv <= q


@pytest.mark.parametrize(
    ("fn", "local_size", "shift", "want"),
    [
        (_causal_fn, None, 0, "causal(offset=0)"),
        (
            lambda b, h, q, kv: (kv <= q) & (kv > q - 4),
            4,
            0,
            "sliding_window(left=3, right=0, offset=0)",
        ),
        (
            lambda b, h, q, kv: (kv <= q) & (kv // 4 == q // 4),
            4,
            0,
            "(chunked(4, offset=0) & causal(offset=0))",
        ),
        (
            lambda b, h, q, kv: (q - kv).abs() <= 4,
            4,
            0,
            "sliding_window(left=4, right=4, offset=0)",
        ),
        (lambda b, h, q, kv: kv >= 0, None, 0, "None"),
    ],
)
def test_structure_recognises_what_transformers_builds(fn, local_size, shift, want):
    found, mask = akt.structure(fn, 2, 16, 16, shift=shift, local_size=local_size)
    assert found and str(mask) == want


def test_structure_falls_back_to_the_function_itself_when_nothing_fits():
    odd = lambda b, h, q, kv: (kv <= q) & ((q + kv) % 3 != 0)  # noqa: E731
    assert akt.structure(odd, 2, 16, 16) == (False, None)
    mask = akt.mask_function(2, 16, 16, mask_function=odd)
    assert "from_mod" in str(mask)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    want = ak.attention(q, k, k, ak.Mask.from_mod(odd), backend="reference")
    torch.testing.assert_close(ak.attention(q, k, k, mask), want)


def test_static_cache_offsets_become_causal_offsets():
    # 3 new queries at positions 5..7 of a static cache of 16 slots, 8 real tokens so far
    padding = torch.ones(1, 8, dtype=torch.bool)
    mask = akt.mask_function(1, 3, 16, q_offset=5, kv_offset=0, attention_mask=padding)
    assert str(mask) == "causal(offset=5) & key_padding(valid, B=1)"
    dense = mask.materialize(1, 1, 3, 16)[0, 0]
    assert dense[:, 8:].sum() == 0 and dense[0, :6].all() and not dense[0, 6]


@pytest.mark.slow
def test_a_compiled_model_gives_the_eager_logits():
    model = _model("mistral")
    batch = _batch()
    model.set_attn_implementation("attnkit")
    with torch.no_grad():
        want = model(**batch).logits
        got = torch.compile(model)(**batch).logits  # the mask function runs eagerly
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def test_a_mask_function_transformers_runs_under_vmap_becomes_its_dense_mask():
    def overlay(b, h, q, kv):  # a user's overlay: transformers evaluates such ones by vmap
        return (kv <= q) | ((q < 3) & (kv < 3))

    mask = akt.mask_function(2, 6, 6, mask_function=overlay, use_vmap=True)
    assert str(mask).startswith("tensor(")  # dense, as transformers builds it
    want = (ak.causal() | ak.Mask.from_mod(lambda b, h, q, kv: (q < 3) & (kv < 3))).materialize(
        2, 1, 6, 6
    )
    assert torch.equal(mask.materialize(2, 1, 6, 6), want)


def test_a_plain_causal_batch_runs_sdpas_causal_kernel():
    """The mask of an unpadded batch is SDPA's is_causal: no mask tensor, no tiles."""
    mask = akt.mask_function(2, 64, 64)
    assert is_sdpa_causal(mask, 64, 64)
    q, k = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16)
    assert ak.explain(q, k, k, mask).backend == "sdpa"
    assert not is_sdpa_causal(ak.causal() & ak.key_padding(torch.tensor([64, 9])), 64, 64)


def test_flash_style_cu_seq_lens_keep_packed_documents_apart():
    """Packed rows described only by cu_seq_lens (flash kwargs): no cross-document leak."""
    model = _model("llama")
    ids = _batch()["input_ids"][:1]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]])
    want = _logits(model, "sdpa", input_ids=ids, position_ids=positions, use_cache=False)
    cu = torch.tensor([0, 6, 9, 11], dtype=torch.int32)
    flash = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 6, "max_length_k": 6}
    got = _logits(model, "attnkit", input_ids=ids, position_ids=positions, use_cache=False, **flash)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    mask = akt._from_cu_seq_lens(flash, 11, 11)
    assert mask is not None and mask.materialize(1, 1, 11, 11)[0, 0, 6, :6].sum() == 0


def test_transformers_causal_function_is_causal_by_definition(monkeypatch):
    """A decoding step's mask needs no check: transformers' `causal_mask_function` is
    `kv_idx <= q_idx`, which the installed version is held to here, pair by pair."""
    from transformers.masking_utils import causal_mask_function

    def at_offset(b, h, i, j):  # queries at positions 7.., keys from 0
        return causal_mask_function(b, h, i + 7, j)

    found, mask = akt.structure(at_offset, 2, 5, 12, shift=7)
    assert found and str(mask) == "causal(offset=7)"
    monkeypatch.setattr(akt_mask, "structure", None)  # never called for it
    mask = akt.mask_function(2, 1, 12, q_offset=11, mask_function=causal_mask_function)
    assert str(mask) == "causal(offset=11)"


def test_a_mask_function_is_checked_at_every_forward_and_its_data_read_anew(monkeypatch):
    """transformers builds its functions anew for each forward (and one may read data
    that changed since): each forward checks its function once, for all its layers."""
    calls = []
    real = akt.structure
    monkeypatch.setattr(akt_mask, "structure", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def window(b, h, q, kv):
        return (kv <= q) & (kv > q - 3)

    for _ in range(3):
        mask = akt.mask_function(2, 8, 8, mask_function=window, local_size=3)
    assert len(calls) == 3 and str(mask) == "sliding_window(left=2, right=0, offset=0)"
    hidden = torch.zeros(8, dtype=torch.bool)

    def holding(b, h, q, kv):  # reads a tensor that may change between calls
        return (kv <= q) & ~hidden[kv]

    first = akt.mask_function(2, 8, 8, mask_function=holding)
    hidden[3] = True
    second = akt.mask_function(2, 8, 8, mask_function=holding)
    assert len(calls) == 5
    assert (
        first.materialize(2, 1, 8, 8)[0, 0, 5, 3] and not second.materialize(2, 1, 8, 8)[0, 0, 5, 3]
    )


def _compile_all_devices(config):
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    return config


def test_generate_with_a_fullgraph_compiled_step_equals_sdpa_and_never_recompiles():
    model = _model("llama")
    batch = _batch()
    outs = {}
    for impl in ("sdpa", "attnkit"):
        model.set_attn_implementation(impl)
        torch._dynamo.reset()
        config = _compile_all_devices(transformers.CompileConfig(fullgraph=True))
        run = dict(
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            compile_config=config,
            pad_token_id=0,
        )
        outs[impl] = model.generate(**batch, **run)
        with torch.compiler.set_stance("fail_on_recompile"):
            again = model.generate(**batch, **run)
        assert torch.equal(again, outs[impl])
    assert torch.equal(outs["sdpa"], outs["attnkit"])


def test_a_fullgraph_compiled_decoding_step_gives_sdpas_logits():
    model = _model("mistral")
    batch = _batch()
    first = batch["input_ids"].shape[1]
    logits = {}
    for impl in ("sdpa", "attnkit"):
        model.set_attn_implementation(impl)
        torch._dynamo.reset()
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            out = model(**batch, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)  # (B, 1)
            mask = torch.cat([batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], 1)
            step = torch.compile(model.forward, fullgraph=True)
            logits[impl] = step(
                input_ids=token,
                attention_mask=mask,
                cache=cache,
                cache_position=torch.tensor([first]),
                use_cache=True,
            ).logits
    torch.testing.assert_close(logits["attnkit"], logits["sdpa"], atol=2e-5, rtol=1e-4)


def test_a_forward_prepares_its_call_once_and_every_layer_runs_it(monkeypatch):
    """Every layer shares the forward's mask object: the first prepares the call (one
    lookup), the others run it, plain and padded, prefill and decoding steps."""
    from attnkit.call import dispatch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3})
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("attnkit")
    lookups = []
    real = dispatch._lookup
    monkeypatch.setattr(dispatch, "_lookup", lambda *a: lookups.append(1) or real(*a))
    batch = _batch()
    for inputs in ({"input_ids": batch["input_ids"]}, batch):
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert len(lookups) == 3  # the prefill and two decoding steps: one each
        lookups.clear()
