"""``python -m fedderm.install``: torch's CPU build unless a GPU is found or the CUDA build is asked
for, a CPU index out of reach said in one line (and the install goes on with pip's own sources),
and the last line: the environment's size on disk and torch's build."""

import http.server
import os
import re
import sys
import threading

import pytest

from fedderm import install


@pytest.mark.parametrize(
    "torch, platform, gpu, build",
    [("auto", "linux", False, "cpu"), ("auto", "linux", True, "cuda"), ("cuda", "linux", False, "cuda"),
     ("cpu", "linux", True, "cpu"), ("auto", "darwin", False, "default"), ("cuda", "win32", True, "default")],
)  # fmt: skip
def test_the_build_is_cpu_unless_a_gpu_is_found_or_cuda_is_asked_for(torch, platform, gpu, build):
    assert install.choose_build(torch, platform, lambda: gpu) == build


def test_the_cpu_build_comes_from_its_index_first_and_only_when_it_answers():
    cpu = install.pip_commands("cpu", "https://idx/cpu", "", "/app")
    assert all(c[1:5] == ["-m", "pip", "install", "--no-compile"] for c in cpu)  # compileall does it
    assert [c[5:] for c in cpu] == [
        ["torch", "torchvision", "--index-url", "https://idx/cpu"],
        ["-e", "/app"],
    ]
    assert [c[5:] for c in install.pip_commands("cpu", "https://idx/cpu", "no route", "/app")] == [
        ["-e", "/app"]
    ]
    assert [c[5:] for c in install.pip_commands("cuda", "https://idx/cpu", "", "/app[test]")] == [
        ["-e", "/app[test]"]
    ]


@pytest.fixture
def index_server():
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def test_a_cpu_index_out_of_reach_is_said_in_one_line_and_pip_installs_the_rest(
    index_server, monkeypatch, capsys
):
    ran = []
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or _Done())
    monkeypatch.setattr(
        install, "report", lambda: "environment: /v, 1.0 GiB on disk · torch 2.9.1+cpu (CPU build)"
    )
    monkeypatch.setattr(sys, "prefix", "/v")  # an active virtual environment
    assert install.main(["--torch", "cpu", "--torch-index", index_server]) == 0
    assert ran[0][5:] == ["torch", "torchvision", "--index-url", index_server] and ran[1][5] == "-e"
    assert ran[2] == install.compile_command() and len(ran) == 3  # after pip, the bytecode
    assert capsys.readouterr().out.splitlines()[-1].endswith("(CPU build)")
    ran.clear()
    closed = "http://127.0.0.1:9/whl/cpu"  # nothing listens on port 9 (discard)
    assert install.main(["--torch", "cpu", "--torch-index", closed, "--extras", "test"]) == 0
    app = install.Path(install.__file__).resolve().parents[1]
    assert len(ran) == 2 and ran[0][5:7] == ["-e", f"{app}[test]"] and ran[1] == install.compile_command()
    said = [line for line in capsys.readouterr().out.splitlines() if "cannot be reached" in line]
    assert len(said) == 1 and closed in said[0]
    # the CPU build asked for and its index answered, but the environment got another: an error
    monkeypatch.setattr(
        install, "report", lambda: "environment: /v, 6.8 GiB on disk · torch 2.9.1 (CUDA 12.8 build)"
    )
    assert install.main(["--torch", "cpu", "--torch-index", index_server]) == 1
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert install.main([]) == 2 and "no virtual environment is active" in capsys.readouterr().err


def test_bytecode_is_compiled_for_every_package_and_a_file_that_does_not_compile_is_no_error(
    tmp_path, monkeypatch
):
    """pip installs with --no-compile; compile_command then compiles the environment's packages
    (here a folder standing for site-packages) on every core, skipping a file that is not Python."""
    import subprocess

    site = tmp_path / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "good.py").write_text("X = 1\n")
    (site / "pkg" / "template.py").write_text("{% if x %}\n")
    monkeypatch.setattr(install.sysconfig, "get_paths", lambda: {"purelib": str(site), "platlib": str(site)})
    cmd = install.compile_command()
    assert cmd.count(str(site)) == 1 and cmd[cmd.index("-j") + 1] == "0"
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.stdout == done.stderr == ""  # quiet, also about the template
    compiled = sorted(p.name.split(".")[0] for p in (site / "pkg" / "__pycache__").iterdir())
    assert compiled == ["good"]


class _Done:
    returncode = 0


def test_the_report_gives_the_size_on_disk_and_torchs_build(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "b")  # a hard link is counted once, as du counts it
    assert 100_000 <= install.folder_size(tmp_path) < 200_000
    line = install.report(tmp_path)
    assert re.fullmatch(
        rf"environment: {re.escape(str(tmp_path))}, 0\.0 GiB on disk · torch \S+ \((CPU|CUDA [\d.]+) build\)",
        line,
    ), line


def test_every_flower_pin_the_docs_state_is_pyprojects():
    import tomllib

    root = install.Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as fh:
        (pin,) = [d for d in tomllib.load(fh)["project"]["dependencies"] if d.startswith("flwr[")]
    stated = {
        (path.name, found)
        for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
        for found in re.findall(r"flwr\[simulation\][<>=!~,.\d ]+\d", path.read_text())
    }
    assert stated and all(found == pin for _, found in stated), (pin, stated)
