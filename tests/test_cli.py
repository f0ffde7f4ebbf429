"""The ``ensemble`` command: argument parsing (fast) and generate on the bundled pair (real); the demo: test_demo.py."""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ensemble_core.cli import build_parser, generate_config, main
from ensemble_core.errors import InvalidOptionError
from ensemble_core.flags import member_options, parse_sets, parse_value


def test_parse_value_and_sets() -> None:
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("None") is None and parse_value("gac") == "gac" and parse_value('["a", "b"]') == ["a", "b"]
    sets = parse_sets(["lookahead=4", "specem.segment-length=8", "stop=[\"\\n\\n\"]"])
    assert sets == {"*": {"lookahead": 4, "stop": ("\n\n",)}, "specem": {"segment_length": 8}}
    with pytest.raises(InvalidOptionError):
        parse_sets(["lookahead"])


def test_generate_config_and_member_options() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--method", "specem", "--segment-length", "6",
                                      "--set", "hedge=false", "--max-new-tokens", "9", "--stop", "###"])
    assert generate_config(args) == {"hedge": False, "max_new_tokens": 9, "segment_length": 6, "stop": ("###",)}
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--device", "cuda:0", "cuda:1", "--dtype", "bfloat16"])
    assert member_options(args, 2) == [{"dtype": "bfloat16", "device": "cuda:0"}, {"dtype": "bfloat16", "device": "cuda:1"}]
    with pytest.raises(InvalidOptionError):
        member_options(args, 3)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--quantize", "none", "int8"])
    assert member_options(args, 2) == [{"dtype": "auto", "quantize": None}, {"dtype": "auto", "quantize": "int8"}]
    with pytest.raises(InvalidOptionError, match="--quantize"):
        member_options(args, 3)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", "float32", "bfloat16"])
    assert member_options(args, 2) == [{"dtype": "float32"}, {"dtype": "bfloat16"}]  # a float32 drafter, a bf16 verifier
    with pytest.raises(InvalidOptionError, match="--dtype"):
        member_options(args, 3)
    args = build_parser().parse_args(["bench"])
    assert args.max_new_tokens == 256 and args.dataset == "gsm8k" and len(args.methods) == 5


def test_bad_input_exits_2_with_a_clear_message_before_loading(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "chat.json"
    bad.write_text("not json", encoding="utf-8")
    assert main(["generate", "--chat-file", str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--lookahead", "0"]) == 2
    assert "Invalid value for 'lookahead'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--set", "segmnt_length=3"]) == 2
    assert "segmnt_length" in capsys.readouterr().err
    # --set reaches --throughput's options (it was dropped there): checked before any member loads
    assert main(["bench", "--throughput", "--methods", "safe", "--set", "safe.prompt_lookup=-1",
                 "--out", str(tmp_path / "throughput")]) == 2
    assert "prompt_lookup" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate"])  # argparse: --prompt or --chat-file is required


def test_chat_file_not_utf8_is_refused_and_a_utf8_bom_is_read(tmp_path: Path, capsys) -> None:
    messages = json.dumps([{"role": "user", "content": "Hi"}])
    utf16 = tmp_path / "utf16.json"  # what Windows PowerShell 5's `>` writes
    utf16.write_text(messages, encoding="utf-16")
    assert main(["generate", "--chat-file", str(utf16)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: The chat file {utf16} is not UTF-8 text") and "UTF-16" in err
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('[{"role": "user", "content": "Caf\u00e9"}]'.encode("latin-1"))
    assert main(["generate", "--chat-file", str(latin1)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    bom = tmp_path / "bom.json"  # PowerShell's `Out-File -Encoding utf8`: read, then refused for the option below
    bom.write_bytes(codecs.BOM_UTF8 + messages.encode("utf-8"))
    assert main(["generate", "--chat-file", str(bom), "--lookahead", "0"]) == 2
    assert "Invalid value for 'lookahead'" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "-5", "65536", "http"])
def test_serve_port_out_of_range_is_a_usage_error(port: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse, before anything binds or loads
        main(["serve", "--members", "tiny:smollm2-135m-instruct", "--port", port])
    assert exit_info.value.code == 2
    assert f"argument --port: {port!r} is not a TCP port" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--port", "0"]).port == 0  # any free port
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535


#: ``ensemble generate --stream`` on a tiny random-weight member, telling at exit how its stream ended.
STREAM_SCRIPT = """
import atexit, sys
import ensemble_core.cli as cli
from ensemble_core.decoding.generation import GenerationStream
from ensemble_core.testing import tiny_member
cli.load_members = lambda args: [tiny_member("smollm2-135m-instruct", initializer_range=0.2)]
streams = []
init = GenerationStream.__init__
GenerationStream.__init__ = lambda self, *a, **k: (init(self, *a, **k), streams.append(self))[0]
atexit.register(lambda: print("finish:", streams[0].result and streams[0].result.finish_reason, file=sys.stderr))
sys.exit(cli.main(sys.argv[1:]))
"""


def test_generate_stream_into_a_closed_pipe_stops_quietly() -> None:
    """``ensemble generate --stream ... | head -c 20``: the reader goes away; no traceback, the
    generation is cancelled (not run to its end), and the status is 141 as for other commands killed by SIGPIPE."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", STREAM_SCRIPT, "generate", "--method", "single", "--prompt", "Hi",
                             "--max-new-tokens", "2000", "--stream"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert os.read(proc.stdout.fileno(), 20)  # the first text arrived, then the reader goes
        proc.stdout.close()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert "finish: cancelled" in err


@pytest.mark.real
def test_generate_plain_stream_and_chat_file(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--method", "safe", "--max-new-tokens", "8", "--prompt", "What is 2 + 2?", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["completion_tokens"] <= 8 + 4 and result["stats"]["method"] == "safe"
    assert "\n".join(lines[:-1]) == result["text"]

    chat = tmp_path / "messages.json"
    chat.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Name a colour."}]), encoding="utf-8")
    assert main(["generate", "--method", "specem", "--segment-length", "4", "--max-new-tokens", "8",
                 "--chat-file", str(chat), "--stream", "--quiet"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.strip() and "\ufffd" not in streamed
