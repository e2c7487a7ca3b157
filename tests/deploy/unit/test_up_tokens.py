"""`modelyard up`'s management token: a fresh one in a new 0600 file of the run's folder, in the
tokens file format the service and the sidecar read, or the operator's file; and the printed way
to use it, which never shows the token. (The whole stack: tests/edge/security/test_default_edge.py.)"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from modelyard.deploy import up
from modelyard.process.auth import Authorizer, AuthSettings, Decision, Scope


def test_a_fresh_token_is_a_management_token_only_its_owner_reads(tmp_path: Path) -> None:
    path = up.tokens_file(up.Settings(), tmp_path)
    assert path.parent == tmp_path and stat.S_IMODE(path.stat().st_mode) == 0o600
    token, scope = path.read_text().split()
    assert scope == "management" and len(token) >= 43  # secrets.token_urlsafe(32)
    authorizer = Authorizer(AuthSettings(path))
    bearer = [("authorization", f"Bearer {token}")]
    assert authorizer.check(bearer, {}, Scope.MANAGEMENT) is Decision.ALLOW
    assert authorizer.check([], {}, Scope.MANAGEMENT) is Decision.UNAUTHENTICATED
    with pytest.raises(FileExistsError):  # never written over (nor through a planted link)
        up.management_token_file(tmp_path)


def test_tokens_differ_from_run_to_run(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    assert (
        up.tokens_file(up.Settings(), first).read_text() != up.tokens_file(up.Settings(), second).read_text()
    )


def test_an_operators_file_is_used_as_it_is_named_from_where_they_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").write_text("s3cret management\n")
    settings = up.parse_settings(["--management-tokens-file", "mine"], environ={})
    path = up.tokens_file(settings, tmp_path / "run")
    assert path == tmp_path / "mine" and path.is_absolute()
    assert not (tmp_path / "run").exists()


def test_the_printed_lines_say_how_and_keep_the_token_in_its_file(tmp_path: Path) -> None:
    path = up.management_token_file(tmp_path)
    token = path.read_text().split()[0]
    text = up.management_help(path, False, "127.0.0.1:8000", "127.0.0.1:50051", "http://127.0.0.1:9101", 8080)
    assert token not in text
    assert f"export MODELYARD_TOKEN=$(cut -d' ' -f1 {path})" in text
    assert (
        'curl -X POST -H "authorization: Bearer $MODELYARD_TOKEN" http://127.0.0.1:8000/v2/repository/index'
        in text
    )
    assert "gRPC 127.0.0.1:50051: metadata authorization: Bearer $MODELYARD_TOKEN" in text
    assert "http://127.0.0.1:9101/canary/scaler" in text and "not through Envoy :8080" in text
    # The line the operator pastes gives the token (a shell reads the file).
    export = next(line.strip() for line in text.splitlines() if "export" in line)
    shell = subprocess.run(
        ["sh", "-c", f'{export} && printf %s "$MODELYARD_TOKEN"'], capture_output=True, text=True
    )
    assert shell.stdout == token
    without_admin = up.management_help(path, True, "127.0.0.1:8000", "127.0.0.1:50052", "", 8080)
    assert "canary" not in without_admin and "a management token of" in without_admin
