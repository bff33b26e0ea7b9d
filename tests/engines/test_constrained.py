"""Constrained decoding on every engine: a reply under a schema, regex, choice or grammar always matches it,
rows with different constraints (or none) share each step, and the mask's edges (a vocabulary narrower than
the logits, a finished grammar, thinking before the answer) behave."""

import json
import re

import jsonschema
import numpy as np
import pytest

import umakit
from umakit.backends import common
from umakit.backends.torch.sampler import TorchOps
from umakit.errors import InvalidArgumentError
from umakit.generate.batch import generate_batch
from umakit.generate.constrain import Constraint, from_options
from umakit.generate.sampling import SamplingParams
from support.oracle import ENGINES
from support.schemas import PERSON

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module", params=sorted(ENGINES))
def model(request, tiny_dir):
    return umakit.load(tiny_dir("llama"), **ENGINES[request.param])


def test_greedy_reply_under_a_schema_parses_and_validates(model):
    result = model.generate("The", schema=PERSON, temperature=0, max_tokens=120, raw=True)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), PERSON)
    # written as json.dumps writes it, and no other whitespace: nothing to run on in
    assert json.dumps(json.loads(result.text), ensure_ascii=False) == result.text


def test_sampled_replies_validate_too(model):
    for seed in range(3):
        result = model.generate("Paris is", schema=PERSON, temperature=1.0, seed=seed, max_tokens=120, raw=True)
        jsonschema.validate(json.loads(result.text), PERSON)


def test_regex_choice_and_grammar(model):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", model.generate("The", regex=r"[0-9]{3}-[a-z]{2}", temperature=0,
                                                             max_tokens=20, raw=True).text)
    assert model.generate("The", choices=["alpha", "beta"], temperature=0.9, seed=1, max_tokens=20,
                          raw=True).text in ("alpha", "beta")
    text = model.generate("The", grammar='start: "x=" NUM\nNUM: /[1-9][0-9]?/', temperature=0, max_tokens=20,
                          raw=True).text
    assert re.fullmatch(r"x=[1-9][0-9]?", text)


def test_rows_with_different_constraints_and_none_share_the_steps(model):
    items = [{"prompt": "The", "schema": PERSON}, {"prompt": "Paris is"},
             {"prompt": "dog", "regex": "[ab]{4}"}, {"prompt": "fox", "choices": ["yes", "no"]},
             {"prompt": "The lazy dog.", "schema": {"type": "object", "properties": {"v": {"enum": [1, 2]}},
                                                    "required": ["v"], "additionalProperties": False}}]
    run = generate_batch(model, items, max_tokens=100, sampling=GREEDY, batch_size=len(items), raw=True)
    jsonschema.validate(json.loads(run[0].text), PERSON)
    assert run[1].finish_reason in ("length", "stop")  # unconstrained: whatever the random model says
    assert re.fullmatch("[ab]{4}", run[2].text) and run[3].text in ("yes", "no")
    assert json.loads(run[4].text)["v"] in (1, 2)
    assert run.stats.steps < run.stats.generated_tokens  # one forward pass served several rows
    # The unconstrained row is exactly what it is alone: the others' masks do not touch it.
    alone = model.generate("Paris is", temperature=0, max_tokens=100, raw=True)
    assert run[1].tokens == alone.tokens


def test_a_batch_option_is_the_default_and_an_item_replaces_it(model):
    run = generate_batch(model, ["The", {"prompt": "dog", "regex": "z+"}], regex="[0-9]{2}", max_tokens=10,
                         sampling=GREEDY, raw=True)
    assert re.fullmatch("[0-9]{2}", run[0].text) and re.fullmatch("z+", run[1].text)


def test_bad_constraints_are_refused_before_any_work(model):
    with pytest.raises(InvalidArgumentError, match="cannot enforce.*look-around"):
        model.generate("The", regex="(?<=a)b")
    with pytest.raises(InvalidArgumentError, match="cannot enforce.*bogus"):
        model.generate("The", schema={"type": "string", "format": "bogus"})
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        model.generate("The", schema="{nope")
    with pytest.raises(InvalidArgumentError, match="at most one of schema, regex"):
        model.generate("The", schema=PERSON, regex="a")
    with pytest.raises(InvalidArgumentError, match="prompt 1: .*cannot enforce"):
        generate_batch(model, ["The", {"prompt": "x", "grammar": "start: undefined_rule"}])
    with pytest.raises(InvalidArgumentError, match="speculative decoding"):
        model.generate("The", regex="a+", prompt_lookup=True)


def test_the_mask_after_thinking(tiny_dir):
    """With ``after``, tokens are free until the marker comes, then constrained."""
    from umakit.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir("llama"))
    marker = tok.encode("</s>", add_special_tokens=False)
    m = Constraint.regex("[0-9]+").starting_after("</s>").matcher(tok)
    assert m.allowed() is None  # thinking: any token
    for t in tok.encode("fox dog", add_special_tokens=False):
        m.accept(t)
    assert m.allowed() is None
    for t in marker:
        m.accept(t)
    mask = m.allowed()
    digits = {t for t in range(len(mask)) if mask[t]}
    assert digits and all(tok.decode([t]).isdigit() for t in digits)


def test_a_finished_grammar_allows_only_the_end_of_sequence(tiny_dir):
    from umakit.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir("llama"))
    m = Constraint.choice(["dog"]).matcher(tok)
    for t in tok.encode("dog", add_special_tokens=False):
        assert m.allowed()[t]
        m.accept(t)
    assert np.flatnonzero(m.allowed()).tolist() == sorted(tok.eos_ids)
    with pytest.raises(InvalidArgumentError, match="broke the constraint"):
        Constraint.choice(["dog"]).matcher(tok).accept(tok.encode("fox", add_special_tokens=False)[0])


class _Short:
    """A constraint whose mask covers fewer ids than the logits (a vocabulary padded in the weights)."""

    def __init__(self, mask):
        self.mask = np.array(mask, dtype=bool)

    def allowed(self):
        return self.mask

    def accept(self, token):
        pass


def test_masks_narrower_than_the_logits_and_unconstrained_rows():
    import torch

    ops = TorchOps()
    rows = [common.TokenSampler(ops, GREEDY, 0, [], constraint=_Short([False, False, True])),
            common.TokenSampler(ops, GREEDY, 0, [])]
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0, 9.0], [0.0, 1.0, 0.5, 9.0, 3.0]])
    out = common.masked(ops, rows, logits)
    assert torch.isinf(out[0, [0, 1, 3, 4]]).all() and out[0, 2] == 0.5  # ids past the mask are not allowed
    assert torch.equal(out[1], logits[1])  # the unconstrained row keeps every logit
    tokens, _ = common.sample_rows(ops, rows, logits)
    assert tokens.tolist() == [2, 3]


def test_from_options_takes_a_constraint_and_nothing():
    c = Constraint.json_object()
    assert from_options(schema=c) is c and from_options() is None
    assert from_options(choices=["a"]).kind == "choice"


def test_an_engine_without_the_feature_is_refused(model):
    from dataclasses import replace

    from umakit.backends.base import refuse_options

    spec = replace(model.engine.spec, features=frozenset())
    with pytest.raises(InvalidArgumentError, match="does not support constrained decoding"):
        refuse_options(spec, constrain=True)


@pytest.mark.slow
def test_the_built_in_model_answers_a_schema_in_full():
    model = umakit.load(backend="torch")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "country", "capital"], "additionalProperties": False}
    result = model.generate("Describe Paris as JSON.", schema=schema, temperature=0, max_tokens=80)
    data = json.loads(result.text)
    jsonschema.validate(data, schema)
    assert data["country"].lower().startswith("fr")


# -- OpenAI's presence and frequency penalties (the server maps them; cheap, so implemented on both engines) ------
def test_presence_and_frequency_penalties_cut_repeats(model):
    prompt = "fox " * 30
    plain = model.generate(prompt, temperature=0, max_tokens=30, raw=True)
    penalized = model.generate(prompt, temperature=0, max_tokens=30, raw=True, frequency_penalty=2.0,
                               presence_penalty=2.0)
    assert len(set(penalized.tokens)) > len(set(plain.tokens))
    # a batch row counts its own tokens exactly as a lone sequence does
    run = generate_batch(model, [prompt, "The"], temperature=0, max_tokens=30, raw=True, frequency_penalty=2.0,
                         presence_penalty=2.0)
    assert run[0].tokens == penalized.tokens
    with pytest.raises(InvalidArgumentError, match="presence_penalty"):
        model.generate("The", presence_penalty=3)
    with pytest.raises(InvalidArgumentError, match="presence and frequency"):
        model.generate("The", presence_penalty=1, prompt_lookup=True)


# -- OpenAI's logit_bias: added to the logits before everything else, on every engine ----------------------------
def test_logit_bias_moves_the_greedy_choice_as_the_biased_logits_say(model):
    ids = model.encode("The lazy", raw=True)
    logits = np.asarray(model.logits(ids)[-1], dtype=np.float64)
    ranked = np.argsort(-logits)
    fifth = int(ranked[4])
    lift = float(logits[ranked[0]] - logits[fifth]) + 1.0  # enough to put the fifth first, and no more
    assert lift <= 100
    lifted = model.generate("The lazy", temperature=0, max_tokens=1, raw=True, logit_bias={fifth: lift})
    assert lifted.tokens == [fifth]
    banned = model.generate("The lazy", temperature=0, max_tokens=1, raw=True, logit_bias={int(ranked[0]): -100})
    assert banned.tokens == [int(ranked[1])]
    # a batch row carries its own bias, beside rows with none or another; each is its lone run
    plain = model.generate("The lazy", temperature=0, max_tokens=6, raw=True)
    lone = model.generate("The lazy", temperature=0, max_tokens=6, raw=True, logit_bias={fifth: lift})
    run = generate_batch(model, ["The lazy", {"prompt": "The lazy", "logit_bias": {fifth: lift}},
                                 {"prompt": "The lazy", "logit_bias": {str(ranked[0]): -100}}],
                         temperature=0, max_tokens=6, raw=True)
    assert run[0].tokens == plain.tokens and run[1].tokens == lone.tokens and run[2].tokens[0] == ranked[1]


@pytest.mark.parametrize("bias, message", [({"x": 1}, "token id"), ({5: 101}, r"\[-100, 100\]"),
                                            ({-1: 1}, "token id"), ({5: float("nan")}, "finite"),
                                            ({5: "a"}, "number")])
def test_a_bad_logit_bias_is_refused_by_name(bias, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_past_the_logits_and_with_speculation_is_refused(model):
    with pytest.raises(InvalidArgumentError, match="logit_bias token id"):
        model.generate("The", max_tokens=1, raw=True, logit_bias={10**7: 5})
    with pytest.raises(InvalidArgumentError, match="logit bias"):
        model.generate("The", max_tokens=4, raw=True, logit_bias={5: 5}, prompt_lookup=True)
