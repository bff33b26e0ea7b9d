"""`umakit batch` through click's runner, and killed mid-run as a real process; OpenAI's batch files too."""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
from click.testing import CliRunner

from umakit.cli.main import COMMANDS, main

from support import proc_helpers
from support.schemas import PERSON

REGISTER = "from umakit.cli.main import COMMANDS, main; COMMANDS.setdefault('batch', 'cli.batch_cmd:batch_cmd'); main()"


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setitem(COMMANDS, "batch", "umakit.cli.batch_cmd:batch_cmd")


def run(*args):
    return CliRunner().invoke(main, ["batch", *map(str, args)])


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_item_gets_one_result_line(tiny_dir, tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "The quick brown fox"},
        {"id": 7, "messages": [{"role": "user", "content": "Paris is"}], "max_tokens": 3},
        {"id": "c", "prompt": "The lazy dog. " * 10, "temperature": 0.9, "seed": 4},
    ])
    out = tmp_path / "out.jsonl"
    # The oracle `tiny_model` is on MLX; seeded draws are reproducible within an engine, not across engines.
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--temp", "0", "--max-tokens", "12", "--raw", "-b", "2",
            "--backend", "mlx", "--device", "cpu")
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in read_jsonl(out)}
    assert set(rows) == {"a", 7, "c"}
    assert set(rows["a"]) == {"id", "text", "finish_reason", "prompt_tokens", "generated_tokens", "ttft_s",
                              "decode_s", "decode_tps", "elapsed_s"}
    want = tiny_model.generate("The quick brown fox", raw=True, temperature=0, max_tokens=12)
    assert rows["a"]["text"] == want.text and rows["a"]["generated_tokens"] == len(want.tokens)
    assert rows[7]["generated_tokens"] <= 3
    sampled = tiny_model.generate("The lazy dog. " * 10, raw=True, temperature=0.9, seed=4, max_tokens=12)
    assert rows["c"]["text"] == sampled.text
    assert "3/3" in r.stderr and "tok/s" in r.stderr
    assert not (tmp_path / "out.errors.jsonl").exists()


def test_malformed_lines_are_reported_and_the_rest_runs(tiny_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "The"},
        "{not json",
        {"prompt": "no id"},
        {"id": 4},
        "",
        {"id": 6, "prompt": "x", "max_token": 3},
        {"id": True, "prompt": "x"},
        "[1, 2]",
        {"id": 9, "prompt": "fox"},
    ])
    out = tmp_path / "results.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--max-tokens", "4")
    assert r.exit_code == 1
    assert [row["id"] for row in sorted(read_jsonl(out), key=lambda x: x["id"])] == [1, 9]
    errors = read_jsonl(tmp_path / "results.errors.jsonl")
    assert [e["line"] for e in errors] == [2, 3, 4, 6, 7, 8]
    assert errors[2] == {"line": 4, "id": 4, "error": "needs 'prompt' or 'messages'"}
    assert "unknown setting(s) max_token" in errors[3]["error"]
    for e in errors:
        assert f"Skipped line {e['line']}: {e['error']}" in r.stderr
    assert r.output.strip().endswith("Error: 6 input line(s) skipped; see " + str(tmp_path / "results.errors.jsonl"))
    assert "Traceback" not in r.output
    write_jsonl(inp, [{"id": 1, "prompt": "The"}, {"id": 2, "prompt": "fox"}])  # fixed: the stale errors go
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--max-tokens", "4")
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "results.errors.jsonl").exists()
    assert sorted(row["id"] for row in read_jsonl(out)) == [1, 2, 9]


def test_duplicate_ids_stop_the_run_before_anything_runs(tiny_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "x"}, {"id": 1, "prompt": "y"}, {"id": "a", "prompt": "z"}, {"id": "1", "prompt": "w"},
    ])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out)
    assert r.exit_code == 1
    assert r.output.strip() == f'Error: {inp}: id "a" appears on lines 1, 3; ids must be unique'
    assert not out.exists()


def test_resume_skips_done_ids_and_cuts_a_torn_line(tiny_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "prompt": k} for k in ("a", "b", "c")])
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a", "text": "DONE BEFORE"}) + '\n{"id": "b", "te')  # crashed mid-write
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--max-tokens", "3")
    assert r.exit_code == 0, r.output
    assert "1 of 3 items already in" in r.stderr
    rows = read_jsonl(out)
    assert sorted(row["id"] for row in rows) == ["a", "b", "c"]
    assert rows[0] == {"id": "a", "text": "DONE BEFORE"}
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--max-tokens", "3")  # all done: nothing runs
    assert r.exit_code == 0 and len(read_jsonl(out)) == 3


def test_the_note_is_printed_when_the_batch_size_is_lowered(tiny_dir, tiny_model, tmp_path, monkeypatch):
    from umakit.backends.mlx.batch_decoder import MLXBatchDecoder
    from umakit.backends.torch.batch_decoder import TorchBatchDecoder

    kv = tiny_model.info.weights.kv_bytes_per_token
    for decoder in (MLXBatchDecoder, TorchBatchDecoder):  # "auto" may pick either engine
        monkeypatch.setattr(decoder, "kv_budget_bytes", lambda self: int(1.5 * 256 * kv))
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "The"} for i in range(3)])
    r = run(tiny_dir("llama"), "-i", inp, "-o", tmp_path / "out.jsonl", "--max-tokens", "3")
    assert r.exit_code == 0, r.output
    assert "Note: batch size lowered from 3 to 1: each sequence may hold 256 tokens" in r.stderr
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 3


def test_a_default_json_schema_and_an_item_that_replaces_it(tiny_dir, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "The quick"},
        {"id": "b", "messages": [{"role": "user", "content": "Paris is"}]},
        {"id": "c", "prompt": "dog", "regex": "[ab]{4}"},
        {"id": "d", "prompt": "fox", "grammar": "start: undefined_rule"},  # set aside before the model loads
    ])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--json-schema", schema, "--temp", "0", "--max-tokens", "100",
            "-b", "3")
    assert r.exit_code == 1 and "Skipped line 4: a grammar umakit cannot enforce" in r.stderr, r.output
    rows = {row["id"]: row for row in read_jsonl(out)}
    assert set(rows) == {"a", "b", "c"}
    for key in ("a", "b"):
        assert rows[key]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(rows[key]["text"]), PERSON)
    assert re.fullmatch("[ab]{4}", rows["c"]["text"])


def test_a_bad_default_constraint_is_one_error_before_anything_runs(tiny_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--json-schema", tmp_path / "nope.json")
    assert r.exit_code == 1 and r.output.strip() == f"Error: no such JSON schema file: {tmp_path / 'nope.json'}"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "--regex", "a+", "--choice", "yes")
    assert r.exit_code == 1
    assert r.output.strip() == "Error: give at most one of --json-schema, --regex, --choice and --grammar (got --regex and --choice)"
    assert not out.exists()


@pytest.mark.slow
def test_a_killed_run_resumes_with_each_id_exactly_once(tiny_dir, tmp_path):
    n = 40
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"The fox {i}"} for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-c", REGISTER, "batch", str(tiny_dir("llama")), "-i", str(inp), "-o", str(out),
           "--temp", "0.8", "--seed", "1", "--raw", "-b", "2"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc_helpers.kill_when(cmd + ["--max-tokens", "480"], lambda: out.exists() and out.read_bytes().count(b"\n") >= 1,
                           "a result line")
    first = out.read_bytes()
    done_first = first.count(b"\n")
    assert 1 <= done_first < n, "the run finished before it was killed: make it slower"
    p = subprocess.run(cmd + ["--max-tokens", "4"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert f"items already in {out}: skipped" in p.stderr
    ids = [row["id"] for row in read_jsonl(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(n))  # every id exactly once
    assert out.read_bytes().startswith(first[: first.rfind(b"\n") + 1])  # finished lines kept as they were


def test_each_result_is_on_disk_as_soon_as_it_is_written(tmp_path):
    from umakit.generate.batch_io import ResultWriter

    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write({"id": 1, "text": "a"})
        assert path.read_text() == '{"id": 1, "text": "a"}\n'  # read through another handle, before close
        w.write({"id": "2", "text": "ü"})
        assert read_jsonl(path) == [{"id": 1, "text": "a"}, {"id": "2", "text": "ü"}]


# -- OpenAI's batch files: each body read as the server reads it, answered in OpenAI's batch output, failures
# in the errors file beside it, resumable by custom_id ----------------------------------------------------------
ENGINE = ("--backend", "torch", "--device", "cpu", "--dtype", "float32")


def line(custom_id, body, url="/v1/chat/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_each_request_answered_as_the_server_answers_it(tiny_dir, torch_models, tmp_path):
    model = torch_models("llama")
    name = model.info.name
    chat = [{"role": "user", "content": "The quick brown fox"}]
    inp = write_jsonl(tmp_path / "in.jsonl", [
        line("chat", {"model": name, "messages": chat, "max_tokens": 6, "temperature": 0}),
        line("text", {"model": name, "prompt": "Paris is", "max_tokens": 5, "temperature": 0}, "/v1/completions"),
        line("resp", {"model": name, "input": "The quick brown fox", "max_output_tokens": 6, "temperature": 0},
             "/v1/responses"),
        line("json", {"model": name, "messages": chat, "max_tokens": 40, "temperature": 0,
                      "response_format": {"type": "json_object"}}),
        line("many", {"model": name, "prompt": ["Paris is", "The quick"], "max_tokens": 4, "temperature": 0,
                      "echo": True}, "/v1/completions"),  # several choices, each its prompt's text first
    ])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "-b", "2", *ENGINE)
    assert r.exit_code == 0, r.output
    rows = {row["custom_id"]: row for row in read_jsonl(out)}
    assert set(rows) == {"chat", "text", "resp", "json", "many"}
    for row in rows.values():
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        assert row["id"].startswith("batch_req_") and row["response"]["status_code"] == 200
        assert row["response"]["request_id"] == row["response"]["body"]["id"]
    want = model.generate(messages=chat, temperature=0, max_tokens=6)
    body = rows["chat"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == name
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["completion_tokens"] == len(want.tokens)
    text = rows["text"]["response"]["body"]
    assert text["choices"][0]["text"] == model.generate("Paris is", raw=True, temperature=0, max_tokens=5).text
    resp = rows["resp"]["response"]["body"]
    assert resp["object"] == "response" and resp["output"][0]["content"][0]["text"] == want.text
    reply = rows["json"]["response"]["body"]["choices"][0]
    if reply["finish_reason"] == "stop":  # a JSON object the reply stopped on parses as one
        assert isinstance(json.loads(reply["message"]["content"]), dict)
    many = rows["many"]["response"]["body"]["choices"]
    assert [(c["index"], c["text"]) for c in many] == [
        (i, p + model.generate(p, raw=True, temperature=0, max_tokens=4).text) for i, p in enumerate(["Paris is",
                                                                                                     "The quick"])]
    assert "5/5" in r.stderr and not (tmp_path / "out.errors.jsonl").exists()


def test_failed_requests_go_to_the_errors_file_and_a_rerun_retries_only_them(tiny_dir, torch_models, tmp_path):
    name = torch_models("llama").info.name
    msgs = [{"role": "user", "content": "Hi"}]
    rows = [
        line("good", {"model": name, "messages": msgs, "max_tokens": 3}),
        line("other-model", {"model": "gpt-4o-mini", "messages": msgs}),
        line("bias", {"model": name, "messages": msgs, "logit_bias": {"999999": 5}}),  # past the vocabulary
        line("embed", {"model": name, "input": "Hi"}, "/v1/embeddings"),
        "{not json",
        {"id": 3, "prompt": "umakit's own item, in an OpenAI file"},
        line("streamed", {"model": name, "messages": msgs, "stream": True}),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, *ENGINE)
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == f"Error: 6 request(s) failed; see {tmp_path / 'out.errors.jsonl'}"
    assert [row["custom_id"] for row in read_jsonl(out)] == ["good"]
    failed = {row["custom_id"]: row for row in read_jsonl(tmp_path / "out.errors.jsonl")}
    assert set(failed) == {"other-model", "bias", "embed", None, "streamed"}  # two lines name no custom_id
    model_error = failed["other-model"]["response"]
    assert model_error["status_code"] == 404 and model_error["body"]["error"]["param"] == "model"
    assert name in model_error["body"]["error"]["message"]
    bias = failed["bias"]["response"]
    assert bias["status_code"] == 400 and bias["body"]["error"]["param"] == "logit_bias"
    assert failed["embed"]["response"] is None and "/v1/embeddings" in failed["embed"]["error"]["message"]
    assert "stream" in failed["streamed"]["error"]["message"]
    lines = [row for row in read_jsonl(tmp_path / "out.errors.jsonl") if row["custom_id"] is None]
    assert [m["error"]["message"][:7] for m in lines] == ["line 5:", "line 6:"]
    assert "Traceback" not in r.output

    rows[1]["body"]["model"] = name  # fixed: the rerun answers it, and only the lines not yet answered
    write_jsonl(inp, rows[:4])
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, *ENGINE)
    assert r.exit_code == 1 and "1 of 3 requests already in" in r.stderr
    assert [row["custom_id"] for row in read_jsonl(out)] == ["good", "other-model"]
    assert {row["custom_id"] for row in read_jsonl(tmp_path / "out.errors.jsonl")} == {"bias", "embed"}
    write_jsonl(inp, rows[:2])
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, *ENGINE)
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "out.errors.jsonl").exists()  # nothing failed this time: the stale file goes


@pytest.mark.parametrize("extra, said", [
    (["--temp", "0.5"], "Error: --temp does not apply to an OpenAI batch file: each line's body sets its own (give "
                        "it there)"),
    (["--system", "Be brief"], "Error: --system does not apply to an OpenAI batch file: each line's body sets its "
                               "own (give it there)"),
])
def test_flags_a_body_sets_are_refused(tmp_path, extra, said):
    inp = write_jsonl(tmp_path / "in.jsonl", [line("a", {"model": "m", "messages": []})])
    r = run("-i", inp, "-o", tmp_path / "out.jsonl", *extra)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == said, r.output
    assert not (tmp_path / "out.jsonl").exists()


def test_a_repeated_custom_id_stops_the_batch_before_it_runs(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [line("a", {"model": "m"}), line("b", {}), line("a", {})])
    r = run("-i", inp, "-o", tmp_path / "out.jsonl")
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [f'Error: {inp}: custom_id "a" appears on lines 1, 3; custom_ids must '
                                             'be unique']
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.errors.jsonl").exists()


def test_a_failure_of_ours_is_that_lines_500_and_the_rest_still_run(tiny_dir, torch_models, tmp_path, monkeypatch):
    import dataclasses

    from umakit.serve import batch_file

    def broken(*args):
        raise RuntimeError("a bug")

    api = batch_file.ROUTES["/v1/completions"]
    monkeypatch.setitem(batch_file.ROUTES, "/v1/completions", dataclasses.replace(api, read=broken))
    name = torch_models("llama").info.name
    inp = write_jsonl(tmp_path / "in.jsonl", [
        line("text", {"model": name, "prompt": "Paris is", "max_tokens": 3}, "/v1/completions"),
        line("chat", {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, *ENGINE)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert [row["custom_id"] for row in read_jsonl(out)] == ["chat"]
    [failed] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert failed["custom_id"] == "text" and failed["response"]["status_code"] == 500
    assert failed["response"]["body"]["error"]["message"] == "internal error: RuntimeError: a bug"
