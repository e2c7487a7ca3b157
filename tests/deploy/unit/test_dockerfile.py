"""deploy/Dockerfile, read as Docker would (no daemon here to build it): the stages and what each
runtime image may hold. Every COPY names a path in the build context (not excluded by
Dockerfile.dockerignore), the runtime images run as the non-root user the base stage creates, hold
no build tools, start the wheel's own command, and install the wheel with an extra that the wheel
declares: the CPU image's default never brings onnxruntime-gpu, the CUDA image's brings NVIDIA's
libraries from the registry (no CUDA base image). The wheel the tests build and install comes
from exactly the wheel stage's copies (tests/installs.py), so those copies suffice for it."""

from __future__ import annotations

import re
import tomllib

from tests.dockerfile import DOCKERFILE, ROOT, copies, excluded, ignored_patterns, stages
from tests.installs import requirements

BUILD_TOOLS = ("gcc", "g++", "build-essential", "make ", "cmake", "git ", "apt-get install")
STAGES = stages()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def base(name: str) -> str:
    return STAGES[name][0][1].split(" AS ")[0].strip()


def runs(name: str) -> str:
    return " ".join(rest for word, rest in STAGES[name] if word == "RUN")


def installed_extra(name: str) -> str:
    """The extra the stage's `pip install "<wheel>[EXTRA]"` names, its ARG default substituted."""
    (extra,) = re.findall(r'pip install "\$\(echo /wheels/modelyard-\*\.whl\)\[([^\]]+)\]"', runs(name))
    defaults = dict(rest.split("=", 1) for word, rest in STAGES[name] if word == "ARG" and "=" in rest)
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], extra)


def test_the_stages_and_their_bases() -> None:
    assert list(STAGES) == ["wheel", "runtime", "cuda", "cpu"]  # cpu last: the default target
    assert base("wheel") == base("runtime") == "python:${PYTHON}-slim"
    assert base("cpu") == base("cuda") == "runtime"  # no CUDA base image


def test_every_copied_path_is_in_the_build_context() -> None:
    pairs = [pair for stage in STAGES for pair in copies(stage)]
    assert pairs
    patterns = ignored_patterns()
    for source, _ in pairs:
        assert (ROOT / source).exists(), source
        assert not excluded(source, patterns), f"{source}: Dockerfile.dockerignore leaves it out"
    # The check of exclusions can fail: the tests folder is out of the context.
    assert excluded("tests/service/unit", patterns) and excluded("gateway/web/node_modules/x", patterns)


def test_runtime_images_run_as_the_user_the_base_makes_and_hold_no_build_tools() -> None:
    made = re.search(r"useradd --uid (\d+) --gid (\d+)", runs("runtime"))
    assert made, "the runtime stage creates the user"
    for name in ("cpu", "cuda"):
        users = [rest for word, rest in STAGES[name] if word == "USER"]
        assert users and users[-1] == f"{made.group(1)}:{made.group(2)}", name
        assert users[-1].split(":")[0] not in ("0", "root"), name
        assert not [tool for tool in BUILD_TOOLS if tool in runs(name) + runs("runtime")], name
        assert "COPY" not in {word for word, _ in STAGES[name]}, "the wheel comes in through a bind mount"
        (entry,) = [rest for word, rest in STAGES[name] if word == "ENTRYPOINT"]
        (command,) = re.fullmatch(r'\["([\w-]+)"\]', entry).groups()
        assert command in PROJECT["scripts"], f"{name}: {command} is not one of the wheel's commands"


def test_the_cpu_image_gets_plain_onnxruntime_and_the_cuda_image_the_nvidia_wheels() -> None:
    extras = PROJECT["optional-dependencies"]
    cpu, cuda = installed_extra("cpu"), installed_extra("cuda")
    assert (cpu, cuda) == ("service-cpu", "service-cuda") and {cpu, cuda} <= set(extras)
    assert "onnxruntime==" in " ".join(requirements(cpu))
    assert not [r for r in requirements(cpu) if r.startswith("onnxruntime-gpu")]
    assert [r for r in requirements(cuda) if r.startswith("onnxruntime-gpu[cuda,cudnn]==")]
    assert "ldconfig" in runs("cuda")
    # The other processes' images: the same stage with their extra (the Dockerfile's own usage).
    named = set(re.findall(r"--build-arg EXTRA=([\w-]+)", DOCKERFILE.read_text()))
    assert named == {"sidecar", "gateway"} and named <= set(extras)
