"""`agentenv.errors.ERROR_TABLE` carries every AgentENV error type from `agentenv serve` to `agentenv.remote`
(no Docker here): the server's HTTP answer and Connect error for each type, decoded by the client, give
that very type back, while the status and Connect code E2B clients read stay E2B's."""

from __future__ import annotations

import inspect
import json

import httpx
import pytest
from connectrpc._protocol import ConnectWireError

from agentenv import errors
from agentenv.errors import ERROR_TABLE, AgentEnvError, CheckpointError, SandboxNotFound, SandboxStateError
from agentenv.remote import _connect_error, _error
from agentenv.server.errors import classify, e2b_json, to_connect

HOST = "http://host:3000"


def test_every_error_type_of_agentenv_is_in_the_table():
    defined = {cls for _name, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, AgentEnvError) and cls.__module__ == errors.__name__}
    assert defined == {row.type for row in ERROR_TABLE}
    names = [row.name for row in ERROR_TABLE]
    assert len(names) == len(set(names))
    for i, row in enumerate(ERROR_TABLE):  # a row never hides a more specific one after it
        assert not any(issubclass(later.type, row.type) for later in ERROR_TABLE[i + 1:]), row.name


@pytest.mark.parametrize("row", ERROR_TABLE, ids=lambda r: r.name)
def test_each_type_round_trips_over_http_and_connect(row):
    error = row.type("what went wrong")
    status, code, name = classify(error)
    assert (status, code.value, name) == (row.status, row.code, row.name)

    answer = e2b_json(status, str(error), name)
    body = json.loads(answer.body)
    assert body == {"code": row.status, "message": "what went wrong"}  # what E2B clients read
    resp = httpx.Response(status, content=answer.body, headers=dict(answer.headers))
    got = _error(resp, HOST, AgentEnvError)
    assert type(got) is row.type and str(got) == f"{HOST}: what went wrong"

    wire = ConnectWireError.from_exception(to_connect(error)).to_dict()
    assert wire["code"] == row.code and wire["message"] == "what went wrong"
    got = _connect_error(json.loads(json.dumps(wire)), HOST)
    assert type(got) is row.type


@pytest.mark.parametrize("python_error, expected", [
    (FileNotFoundError("gone"), errors.FileNotFoundInSandbox),
    (FileExistsError("there"), errors.FileExistsInSandbox),
    (NotADirectoryError("file"), errors.NotADirectoryInSandbox),
])
def test_python_file_errors_travel_as_the_sandbox_ones(python_error, expected):
    status, _code, name = classify(python_error)
    assert name == expected.__name__
    resp = httpx.Response(status, json={"code": status, "message": str(python_error)},
                          headers={errors.ERROR_HEADER: name})
    assert type(_error(resp, HOST, AgentEnvError)) is expected


def test_answers_without_a_name_become_the_most_general_type_of_their_status():
    def plain(status: int) -> httpx.Response:
        return httpx.Response(status, json={"code": status, "message": "refused"})

    assert type(_error(plain(404), HOST, AgentEnvError)) is SandboxNotFound
    assert type(_error(plain(409), HOST, AgentEnvError)) is SandboxStateError
    assert type(_error(plain(503), HOST, AgentEnvError)) is errors.BackendUnavailable
    assert type(_error(plain(400), HOST, AgentEnvError)) is AgentEnvError
    assert type(_error(plain(500), HOST, CheckpointError)) is CheckpointError  # a lifecycle call's 500
    assert type(_error(plain(500), HOST, AgentEnvError)) is AgentEnvError
    assert "api_key" in str(_error(plain(401), HOST, AgentEnvError))
    assert type(_connect_error({"code": "failed_precondition", "message": "x"}, HOST)) is SandboxStateError
    assert type(_connect_error({"code": "internal", "message": "x"}, HOST)) is AgentEnvError
    status, code, name = classify(KeyError("a bug"))
    assert (status, code.value, name) == (500, "internal", None)
