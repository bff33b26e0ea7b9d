"""`umakit generate` through click's runner and as a real installed command."""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
from click.testing import CliRunner

from umakit.cli.main import main
from support.markers import requires_default_model
from support.schemas import PERSON


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_generate_streams_text_and_stats(tiny_dir):
    r = run("generate", "-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "6", "--raw")
    assert r.exit_code == 0, r.output
    text, stats = r.stdout, r.stderr
    assert len(text) > 0
    assert stats.startswith("[length] prompt ") and "decode " in stats and " tok/s" in stats and "% of " in stats


def test_generate_json(tiny_dir):
    r = run("generate", "-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 5
    assert set(out["stats"]) >= {"prompt_tokens", "ttft_s", "prefill_tps", "decode_tps", "peak_memory_bytes",
                                 "bytes_per_token", "achieved_gbps", "mbu"}
    from umakit.backends import resolve

    assert out["backend"] == resolve("auto")[0]


def test_generate_prompt_from_stdin_matches_argument(tiny_dir):
    args = ["generate", "-m", str(tiny_dir("llama")), "--temp", "0", "--max-tokens", "5", "--json"]
    a = json.loads(run(*args, "-p", "The quick").stdout)
    b = json.loads(run(*args, "-p", "-", input="The quick").stdout)
    assert a["tokens"] == b["tokens"]


def test_prompt_as_argument_and_model_as_either(tiny_dir):
    """generate's PROMPT is -p's prompt; the other commands take -m/--model as their MODEL argument."""
    model = str(tiny_dir("llama"))
    args = ["generate", "-m", model, "--temp", "0", "--max-tokens", "5", "--json"]
    a = json.loads(run(*args, "-p", "The quick").stdout)
    b = json.loads(run(*args, "The quick").stdout)
    c = json.loads(run("generate", model, "The quick", *args[3:]).stdout)  # `generate MODEL PROMPT`
    d = json.loads(run("generate", model, "-m", model, "The quick", *args[3:]).stdout)
    e = json.loads(run("generate", model, "-p", "The quick", *args[3:]).stdout)  # `generate MODEL -p PROMPT`
    assert a["tokens"] == b["tokens"] == c["tokens"] == d["tokens"] == e["tokens"] and len(a["tokens"]) == 5
    r = run("generate", model, *args[3:])  # a model on disk is no prompt
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        f"Error: {model!r} is a model on disk, not a prompt: give the prompt too (umakit generate {model} PROMPT)")
    plans = [run("plan", *how, "--json") for how in ([model], ["-m", model], ["--model", model], [model, "-m", model])]
    assert all(r.exit_code == 0 for r in plans), [r.output for r in plans]
    assert len({r.stdout for r in plans}) == 1 and json.loads(plans[0].stdout)
    r = run("eval", "-m", model, "--text", __file__, "--max-tokens", "64")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("argv, said", [
    (["generate", "-m", "x", "one", "-p", "two"], "Error: two prompts given, PROMPT and -p/--prompt: give one"),
    (["generate", "x", "one", "-p", "two"], "Error: two prompts given, PROMPT and -p/--prompt: give one"),
    (["generate", "a", "one", "-m", "b"], "Error: two models given, 'a' and -m 'b': give one"),
    (["generate", "a", "one", "two"], "Error: 3 arguments given: generate takes [MODEL] PROMPT (quote a prompt of "
                                      "several words)"),
    (["generate", "-m", "x"], "Error: no prompt: give it as PROMPT or with -p/--prompt ('-' reads it from stdin)"),
    (["run", "a", "-m", "b"], "Error: two models given, 'a' and -m 'b': give one"),
    (["bench", "a", "--model", "b"], "Error: two models given, 'a' and -m 'b': give one"),
    (["batch", "a", "-m", "b", "-i", __file__, "-o", "out.jsonl"], "Error: two models given, 'a' and -m 'b': give one"),
])
def test_a_model_or_prompt_given_twice_is_refused(argv, said):
    r = run(*argv)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == said, r.output


def test_user_mistakes_are_one_line_errors(tiny_dir, tmp_path):
    r = run("generate", "-m", str(tmp_path / "missing"), "-p", "x")
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [f"Error: model not found: {tmp_path / 'missing'} (no such directory, file or Hub repo id)"]
    r = run("generate", "-m", str(tiny_dir("llama")), "-p", "x", "--backend", "tpu")
    assert r.exit_code == 1 and "unknown backend 'tpu'" in r.output and "Traceback" not in r.output
    r = run("generate", "-m", str(tiny_dir("llama")), "-p", "x", "--temp", "-1")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_generate_under_a_json_schema_prints_json_that_validates(tiny_dir, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = run("generate", "-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "120",
            "--json-schema", str(schema))
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("[stop] ")
    jsonschema.validate(json.loads(r.stdout), PERSON)


def test_generate_under_a_regex_a_choice_and_a_grammar(tiny_dir, tmp_path):
    args = ["generate", "-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "20", "--raw"]
    r = run(*args, "--regex", "[0-9]{3}-[a-z]{2}")
    assert r.exit_code == 0, r.output
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}\n", r.stdout)
    r = run(*args, "--choice", "alpha", "--choice", "beta", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["text"] in ("alpha", "beta")
    grammar = tmp_path / "assign.lark"
    grammar.write_text('start: "x=" NUM\nNUM: /[1-9][0-9]?/\n')
    r = run(*args, "--grammar", str(grammar))
    assert r.exit_code == 0, r.output
    assert re.fullmatch(r"x=[1-9][0-9]?\n", r.stdout)


def test_bad_constraints_are_one_line_errors_before_the_model_loads(tmp_path):
    """Each is refused before loading: the model path here does not even exist."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(PERSON))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"type": "object",')
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"type": "string", "format": "bogus"}')
    cases = [
        (["--json-schema", str(good), "--regex", "a+"],
         "Error: give at most one of --json-schema, --regex, --choice and --grammar (got --json-schema and --regex)"),
        (["--json-schema", str(tmp_path / "nope.json")], f"Error: no such JSON schema file: {tmp_path / 'nope.json'}"),
        (["--json-schema", str(tmp_path)], f"Error: {tmp_path} is a directory, not a JSON schema file"),
        (["--json-schema", str(bad_json)], "Error: the JSON schema is not valid JSON ("),
        (["--json-schema", str(bogus)], "Error: a JSON schema umakit cannot enforce: "),
        (["--regex", "(?<=a)b"], "Error: a regex umakit cannot enforce: "),
        (["--grammar", str(tmp_path / "nope.lark")], f"Error: no such grammar file: {tmp_path / 'nope.lark'}"),
    ]
    for flags, error in cases:
        r = run("generate", "-m", str(tmp_path / "missing"), "-p", "x", *flags)
        assert r.exit_code == 1, (flags, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(error), (flags, r.output)


def test_installed_command_in_a_subprocess(tiny_dir):
    exe = os.path.join(os.path.dirname(sys.executable), "umakit")
    p = subprocess.run(
        [exe, "generate", "-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["tokens"]) == 4
    p = subprocess.run([exe, "generate", "-m", "/definitely/not/here", "-p", "x"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip() == "Error: model not found: /definitely/not/here (no such directory, file or Hub repo id)"
    # `python -m umakit` is the same command, for an environment whose scripts are not on PATH
    p = subprocess.run([sys.executable, "-m", "umakit", "generate", "/definitely/not/here", "x"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip() == ("Error: model not found: /definitely/not/here (no such "
                                                      "directory, file or Hub repo id)")
    p = subprocess.run([sys.executable, "-m", "umakit", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("Usage: umakit [OPTIONS] COMMAND")


def test_import_umakit_imports_no_engine():
    heavy = ("torch", "mlx", "mlx_lm", "gguf", "transformers")
    code = ("import sys, umakit; umakit.SamplingParams; umakit.UmakitError; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
    # ...and the heavy names still arrive on first use
    code = "import sys, umakit; umakit.import_gguf; umakit.load_synthetic; print('gguf' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr
    # ...and so do the subpackages the docs call through `umakit.` (and the public classes, from their new homes)
    code = ("import umakit; umakit.serve.make_app; umakit.quantize.quantize; umakit.BatchRun; umakit.LoadInfo; "
            "print(umakit.Model.__module__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "umakit.api", p.stderr


@requires_default_model
@pytest.mark.slow
def test_the_readmes_first_example_answers_as_the_float32_path_does():
    """The first thing a newcomer runs: on the CPU default (int4 kernels, the fused decode step) the built-in
    model's greedy answer is float32's. It is a near tie of two first tokens, which a prefill of bfloat16-rounded
    rows once tipped to "L'Étoile, la Marseillaise, ..." repeated to 512 tokens."""
    import umakit

    prompt = "What is the capital of France?"
    r = run("generate", "--prompt", prompt, "--temp", "0", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["backend"] == "torch" and out["device"] == "cpu"
    default = umakit.load()
    if "int4" not in default.info.weights.quantization:
        pytest.skip(f"the CPU default here is not the int4 form: {default.info.weights.quantization}")
    exact = umakit.load(backend="torch", device="cpu", dtype="float32").generate(prompt, temperature=0)
    assert out["text"] == exact.text and out["finish_reason"] == "stop"
