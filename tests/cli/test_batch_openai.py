"""`umakit batch` on OpenAI's batch files: each line's body read as the server reads it, answered in OpenAI's
batch output, failures in the errors file beside it, resumable by custom_id."""

import json

import pytest
from click.testing import CliRunner

from umakit.cli.main import COMMANDS, main

ENGINE = ("--backend", "torch", "--device", "cpu", "--dtype", "float32")


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
    ])
    out = tmp_path / "out.jsonl"
    r = run(tiny_dir("llama"), "-i", inp, "-o", out, "-b", "2", *ENGINE)
    assert r.exit_code == 0, r.output
    rows = {row["custom_id"]: row for row in read_jsonl(out)}
    assert set(rows) == {"chat", "text", "resp", "json"}
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
    assert "4/4" in r.stderr and not (tmp_path / "out.errors.jsonl").exists()


def test_failed_requests_go_to_the_errors_file_and_a_rerun_retries_only_them(tiny_dir, torch_models, tmp_path):
    name = torch_models("llama").info.name
    msgs = [{"role": "user", "content": "Hi"}]
    rows = [
        line("good", {"model": name, "messages": msgs, "max_tokens": 3}),
        line("other-model", {"model": "gpt-4o-mini", "messages": msgs}),
        line("bias", {"model": name, "messages": msgs, "logit_bias": {"1": 5}}),
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
