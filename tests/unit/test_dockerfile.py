"""deploy/Dockerfile, read as Docker would (no daemon here to build it): the stages and what each
runtime image may hold. Every COPY names a path in the repository, the runtime images run as a
non-root user and are built from the slim base without build tools, the CPU image installs plain
onnxruntime, and the CUDA image takes NVIDIA's libraries from PyPI (no CUDA base image)."""

from __future__ import annotations

import re
import shlex

from tests.support import REPO_ROOT

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make ", "cmake", "git ", "apt-get install")


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (continuations joined, comments dropped)."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")),
    )
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            current = [("FROM", rest)]
            found[rest.split(" AS ")[1].strip()] = current
        elif current:
            current.append((word.upper(), rest.strip()))
    return found


STAGES = stages()


def base(name: str) -> str:
    return STAGES[name][0][1].split(" AS ")[0].strip()


def test_the_stages_and_their_bases() -> None:
    assert list(STAGES) == ["wheel", "runtime", "cuda", "cpu"]  # cpu last: the default target
    assert base("wheel") == base("runtime") == "python:${PYTHON}-slim"
    assert base("cpu") == base("cuda") == "runtime"  # no CUDA base image


def test_every_copied_path_is_in_the_repository() -> None:
    copied = [rest for stage in STAGES.values() for word, rest in stage if word == "COPY"]
    assert copied
    for rest in copied:
        *sources, _ = shlex.split(rest)
        for source in sources:
            assert (REPO_ROOT / source).exists(), source


def test_runtime_images_run_as_a_user_and_hold_no_build_tools() -> None:
    for name in ("cpu", "cuda"):
        instructions = STAGES[name] + STAGES["runtime"]
        users = [rest for word, rest in STAGES[name] if word == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), name
        runs = " ".join(rest for word, rest in instructions if word == "RUN")
        assert not [tool for tool in BUILD_TOOLS if tool in runs], name
        assert "COPY" not in {word for word, _ in STAGES[name]}, "the wheel comes in through a bind mount"
        assert ("ENTRYPOINT", '["modelyard"]') in STAGES[name]


def test_the_cpu_image_gets_plain_onnxruntime_and_the_cuda_image_the_nvidia_wheels() -> None:
    cpu = " ".join(rest for word, rest in STAGES["cpu"] if word == "RUN")
    cuda = " ".join(rest for word, rest in STAGES["cuda"] if word == "RUN")
    assert 'modelyard.deploy.requirements "${EXTRA}" --cpu' in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime-gpu[cuda,cudnn]" in cuda and "ldconfig" in cuda
