"""The CLI's promise: bad input gets one clear line on stderr, a non-zero exit status, never a traceback.

Most cases run the CLI's `main` in the test process (a subprocess spends ~3 s importing before it parses an
argument, ~9 s with a target); three run the installed command in a subprocess of its own, so that the real
entry point's exit status and stderr are held to the same promise.
"""

import io
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from specdecode.paths import check_writable_folder

CONTEXT = 8192  # max_position_embeddings of the default target, smollm2-135m
LONG_PROMPT = "hello " * 9000  # 9001 tokens with SmolLM2's tokenizer; the test checks it from the error


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # nothing here may reach a model hub
    # One thread: on a busy shared CPU, OpenMP threads spinning at barriers make each pass ~50x slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def run_main(capfd: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """The CLI's `main` in this process, with what it wrote to stdout and stderr: for checks that need no fresh
    process (a subprocess spends ~3 s importing torch and transformers before it parses an argument). The
    subprocess cases below hold the real entry point to the same promise."""
    from specdecode.cli import main

    capfd.readouterr()  # what earlier code of this process wrote is not this command's
    code = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(done: subprocess.CompletedProcess, expected: str) -> str:
    """Non-zero exit, no traceback, exactly one line on stderr, and that line names the problem."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert expected.lower() in lines[0].lower(), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory) -> str:
    """A tiny random Llama whose vocabulary (1000) differs from the target's (49152); no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
    )
    folder = tmp_path_factory.mktemp("other-vocab")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def broken_config_model(tmp_path_factory) -> str:
    """A folder whose config.json is not JSON."""
    folder = tmp_path_factory.mktemp("broken-config")
    (folder / "config.json").write_text("not json {")
    return str(folder)


VALIDATION_CASES = [
    (["generate", "hi", "--target", "no-such-model"], "unknown model"),
    (["generate", ""], "empty"),
    (["generate", "   "], "empty"),
    (["generate", "hi", "--temperature", "-0.5"], "temperature"),
    (["generate", "hi", "--temperature", "abc"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--raw", "--system", "Be brief."], "--system needs the chat template"),
    (["cost", "--hardware", "nope"], "unknown hardware"),
    (["cost", "--dtype", "nope"], "unknown dtype"),
    (["cost", "--positions", "0"], "positions"),
    (["train", "--drafter", "dspark", "--data", "d", "--out", "o", "--max-conversations", "0"], "max-conversations"),
    (["data", "self-prompts", "--out", "o", "--attempts", "0"], "attempts"),
    (["data", "self-prompts", "--out", "o", "--top-p", "0"], "top_p"),
    (["bench", "drafting", "--requests", "0,2"], "--requests must be integers >= 1"),
    (["bench", "drafting", "--contexts", "99999", "--out", "o"], "passes smollm2-135m's context of 8192"),
    (["serve", "--port", "99999"], "--port must be in 0..65535"),
    (["serve", "--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
]


@pytest.mark.parametrize(("args", "expected"), VALIDATION_CASES, ids=[" ".join(a) for a, _ in VALIDATION_CASES])
def test_bad_arguments_give_one_line(args, expected, capfd, smollm2):
    """Bad arguments (including an argparse type error) exit non-zero with one clear line, no traceback (one
    would fail the test here). Some are checked after the target loads (the context of `bench drafting`), so
    this process's target is loaded and planned first: a machine's first load prints a note of its own."""
    assert_one_line_error(run_main(capfd, *args), expected)


def test_serve_on_a_taken_port_gives_one_line_before_loading(capfd):
    """uvicorn found a taken port only after the model had loaded, and exited 3 among its log lines."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_main(capfd, "serve", "--port", str(port))
    assert "in use" in assert_one_line_error(done, f"cannot listen on 127.0.0.1:{port}")


def test_a_cache_folder_that_cannot_be_made_gives_one_line(capfd, tmp_path, monkeypatch):
    """XDG_CACHE_HOME naming a file (or a read-only place) was a FileNotFoundError's traceback."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    assert_one_line_error(run_main(capfd, "generate", "hi"), "cannot create the cache folder")


WRITING_COMMANDS = [["bench", "premise"], ["eval", "--drafter", "ngram"], ["data", "pack", "--data", "d"]]


@pytest.mark.parametrize("command", WRITING_COMMANDS)
def test_an_output_that_cannot_be_written_is_refused_before_the_work(command, capfd, tmp_path):
    """A benchmark ran its minutes and lost them to a traceback when it wrote; the folder is tried first (and a
    folder made only to try it is removed)."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / ("packed.npz" if "pack" in command else "results")
    assert_one_line_error(run_main(capfd, *command, "--out", str(out)), "cannot write to")
    check_writable_folder(tmp_path / "new" / "results")
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]


LOADED_CASES = [
    (["generate", "hi", "--drafter", "nope"], "unknown drafter"),
    (["generate", "hi", "--drafter", "draft-model", "--draft-model", "{other_vocab_model}"], "vocabulary"),
    (["generate", "hi", "--drafter", "draft-model", "--draft-model", "{broken_config_model}"], "draft model"),
]


@pytest.mark.parametrize(("args", "expected"), LOADED_CASES, ids=["unknown-drafter", "other-vocab", "broken-config"])
def test_errors_after_loading_give_one_line(args, expected, capfd, smollm2, other_vocab_model, broken_config_model):
    """Errors found once the target is loaded are still one line: no weight-loading bar, no traceback."""
    folders = {"other_vocab_model": other_vocab_model, "broken_config_model": broken_config_model}
    assert_one_line_error(run_main(capfd, *[a.format(**folders) for a in args]), expected)


def test_the_installed_command_gives_one_line_after_loading(converted_target):
    """The same promise through the real entry point, in a process of its own: its exit status and stderr."""
    assert_one_line_error(run_cli("generate", "hi", "--drafter", "nope"), "unknown drafter")


def test_prompt_longer_than_context_gives_one_line(converted_target):
    """A raw prompt of more tokens than the target's context is refused with one line naming the context."""
    line = assert_one_line_error(run_cli("generate", LONG_PROMPT, "--raw", "--drafter", "none"), "context")
    numbers = re.search(r"prompt has (\d+) tokens .* context holds (\d+)", line)
    assert numbers, line
    prompt_tokens, context = int(numbers.group(1)), int(numbers.group(2))
    assert context == CONTEXT
    assert prompt_tokens > context  # the prompt really exceeds the context, so this is the check that fired


def test_generate_json_success(converted_target):
    """A good request exits 0 and prints valid JSON with the text, token ids and decoding statistics."""
    done = run_cli("generate", "Say hi.", "--max-new-tokens", "8", "--json", "--drafter", "ngram")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["scheduler"] == "fixed"  # `auto`: n-gram drafts carry no confidences
    assert len(result["completions"]) == 1
    completion = result["completions"][0]
    for key in ("text", "token_ids", "accepted_lengths", "mean_accepted_length", "target_passes", "wall_s"):
        assert key in completion, key
    assert isinstance(completion["text"], str)
    assert 1 <= len(completion["token_ids"]) <= 8
    assert all(isinstance(t, int) for t in completion["token_ids"])
    assert sum(completion["accepted_lengths"]) >= len(completion["token_ids"])
    assert completion["target_passes"] == len(completion["accepted_lengths"])


def test_generate_defaults_to_the_prefix_scheduler_and_stays_lossless(capfd, smollm2):
    """With no options, `generate` runs the default drafter (suffix decoding + the shipped DSpark) under DSpark's
    prefix scheduler, and at temperature 0 its tokens are normal greedy decoding's."""
    runs = {}
    args = ("generate", "List three prime numbers.", "--max-new-tokens", "24", "--json")
    for drafter in ("default", "none"):
        done = run_main(capfd, *args, "--drafter", drafter)
        assert done.returncode == 0, done.stderr
        runs[drafter] = json.loads(done.stdout)
    assert runs["default"]["scheduler"] == "prefix" and runs["none"]["scheduler"] == "fixed"
    tokens = {d: r["completions"][0]["token_ids"] for d, r in runs.items()}
    assert tokens["default"] == tokens["none"] and len(tokens["none"]) >= 8


def test_seeded_samples_are_reproducible(capfd, smollm2):
    """--num-samples 3 gives three completions, and the same seed gives the same token ids on a rerun."""
    args = ("generate", "Say hi.", "--max-new-tokens", "8", "--num-samples", "3", "--temperature", "0.8")
    runs = []
    for _ in range(2):
        done = run_main(capfd, *args, "--seed", "1", "--json")
        assert done.returncode == 0, done.stderr
        completions = json.loads(done.stdout)["completions"]
        assert len(completions) == 3
        runs.append([c["token_ids"] for c in completions])
    assert runs[0] == runs[1]


def test_generate_reads_a_prompt_from_standard_input(capfd, monkeypatch, smollm2):
    """`generate -` takes the prompt from standard input (a file's text, a pipe) and decodes it as if given in the
    command line; an empty input is the empty prompt's one-line error."""
    args = ("--max-new-tokens", "6", "--json", "--drafter", "none")
    given = run_main(capfd, "generate", "Say hi.", *args)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hi."))
    piped = run_main(capfd, "generate", "-", *args)
    assert piped.returncode == given.returncode == 0, piped.stderr
    texts = [[(c["text"], c["token_ids"]) for c in json.loads(done.stdout)["completions"]] for done in (piped, given)]
    assert texts[0] == texts[1]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert_one_line_error(run_main(capfd, "generate", "-"), "empty")


def test_generate_says_when_the_context_leaves_less_than_asked(capfd, tmp_path):
    """A prompt that leaves fewer than --max-new-tokens positions in the target's context generates what fits and
    says so, instead of stopping short without a word (a tiny local target with a 256-token context)."""
    from tests.conftest import tiny_llama, tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_llama(vocab_size=24).save_pretrained(folder)
    tiny_tokenizer(24).save_pretrained(folder)
    prompt = " ".join(f"t{2 + i % 8}" for i in range(250))  # a token a word
    done = run_main(capfd, "generate", prompt, "--raw", "--target", str(folder), "--drafter", "none", "--json")
    assert done.returncode == 0, done.stderr
    assert "context holds 256 tokens: 6 new at most" in done.stderr
    assert len(json.loads(done.stdout)["completions"][0]["token_ids"]) <= 6


TRAIN = ["train", "--drafter", "dspark", "--data", "d", "--out", "o"]
TRAINING_CASES = [
    (["--lr", "-1"], "learning rate must be a finite number >= 0"),
    (["--lr", "nan"], "learning rate must be a finite number >= 0"),
    (["--batch-size", "0"], "micro-batch size must be >= 1"),
    (["--grad-accum", "0"], "gradient accumulation must be >= 1"),
    (["--epochs", "0"], "epochs must be >= 1"),
    (["--max-steps", "0"], "max steps must be >= 1"),
    (["--save-every", "0"], "steps between checkpoints must be >= 1"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--fill-in", "--block-size", "1"], "--block-size must be >= 2"),
    (["--markov-rank", "-1"], "--markov-rank must be >= 0"),
    (["--anchors", "0"], "--anchors must be >= 1"),
    (["--drafter", "eagle3", "--ttt-steps", "0"], "--ttt-steps must be >= 1"),
    (["--drafter", "eagle3", "--anchors", "-1"], "--anchors must be >= 0"),
]


@pytest.mark.parametrize(("extra", "expected"), TRAINING_CASES, ids=[" ".join(a) for a, _ in TRAINING_CASES])
def test_training_settings_no_run_could_take_are_refused_before_loading(extra, expected, capfd, monkeypatch):
    """Settings that failed minutes in, on a tensor shape or in the optimizer (tracebacks), or that trained
    nothing and wrote it as a drafter (0 epochs, 0 layers), are one line, before the target loads."""
    import specdecode.cli

    def no_loading(args):
        raise AssertionError("the target was loaded before the settings were checked")

    monkeypatch.setattr(specdecode.cli, "_load_target", no_loading)
    assert_one_line_error(run_main(capfd, *TRAIN, *extra), expected)


def test_training_data_that_is_not_there_is_refused_before_loading(capfd, monkeypatch, tmp_path):
    """A folder without shards (the shipped set's folder, which holds a packed .npz: the line names it) or a
    packed set that does not exist is one line before the target loads, not after."""
    import specdecode.cli

    monkeypatch.setattr(specdecode.cli, "_load_target", lambda args: pytest.fail("the target was loaded"))
    (tmp_path / "smollm2-135m.npz").write_bytes(b"")
    out = ["--out", str(tmp_path / "run")]
    line = assert_one_line_error(run_main(capfd, *TRAIN[:3], "--data", str(tmp_path), *out), "no regenerated")
    assert f"--data {tmp_path / 'smollm2-135m.npz'}" in line
    missing = str(tmp_path / "missing.npz")
    assert_one_line_error(run_main(capfd, *TRAIN[:3], "--data", missing, *out), "no packed training set")


def test_chat_answers_each_line_with_the_conversation_so_far(capfd, monkeypatch, smollm2):
    """`specdecode chat`: each line is a user turn answered from the whole conversation, at T = 0 exactly as normal
    greedy decoding answers those turns; /reset forgets the conversation; a turn past the context is one line on
    stderr and the chat goes on; the end of the input ends it."""
    from specdecode.drafters.base import Drafter
    from specdecode.engine.decode import SpeculativeDecoder
    from specdecode.sampling import SamplingParams

    normal = SpeculativeDecoder(smollm2, Drafter(), draft_length=0)
    messages, replies = [{"role": "system", "content": "Be brief."}], []
    for turn in ("Name a colour.", "And another one?"):
        messages.append({"role": "user", "content": turn})
        ids = smollm2.encode_chat(messages)
        replies.append(normal.generate(ids, SamplingParams(), max_new_tokens=12)[0].text)
        messages.append({"role": "assistant", "content": replies[-1]})
    fresh = normal.generate(smollm2.encode_chat([messages[0], messages[3]]), SamplingParams(), max_new_tokens=12)[0]
    lines = ["Name a colour.", "", "And another one?", "word " * 9000, "/reset", "And another one?"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    done = run_main(capfd, "chat", "--system", "Be brief.", "--max-new-tokens", "12", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(f"{text}\n" for text in (*replies, fresh.text))
    assert "context holds" in done.stderr and "/reset starts a new conversation" in done.stderr
    assert done.stderr.count("mean accepted length") == 3 and "Traceback" not in done.stderr
    once = run_main(capfd, "generate", "Name a colour.", "--system", "Be brief.", "--max-new-tokens", "12", "--json")
    assert json.loads(once.stdout)["completions"][0]["text"] == replies[0]  # generate's --system: the same turn
