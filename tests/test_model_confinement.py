"""A load's overrides (and the config itself) reach nothing outside the model:
every file a field names lies inside the model's folder and is a regular file
of bounded size, checked before anything is opened, so a FIFO or a device
named or planted there never holds a load (and the model's lock); every size
a config asks the server to allocate is bounded."""

import contextlib
import json
import os
import pathlib

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as oip

from services.model_server.core import MAX_OVERRIDES_BYTES
from services.model_server.repository import (
    MAX_GOLDEN_BYTES,
    MAX_TOKENIZER_BYTES,
    ConfigError,
    load_config,
    read_bounded,
)
from tests.test_model_repository import ADMIN, model_server, repo  # noqa: F401 - the mlp repository fixture

ATTACK_TIMEOUT_S = 20  # a load that waits on a FIFO would wait forever: this bounds the test instead


@contextlib.contextmanager
def fifos(*paths: pathlib.Path):
    """FIFOs at `paths`; on the way out each is opened for writing and closed,
    so that a reader the code under test left waiting on one (as it did when
    it opened what an override named) gets an end of file and lets go, and
    removed."""
    for path in paths:
        os.mkfifo(path)
    try:
        yield paths
    finally:
        for path in paths:
            with contextlib.suppress(OSError):  # ENXIO: nobody reads it, as it should be
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            path.unlink()


def _golden(file: str) -> dict:
    return {"golden_probe": {"file": file, "max_abs": 1e-4}}


async def _refused(server, overrides: dict, *complaints: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await server.oip.RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(
                model_name="mlp",
                parameters={"config": oip.ModelRepositoryParameter(string_param=json.dumps(overrides))},
            ),
            timeout=ATTACK_TIMEOUT_S,
            metadata=ADMIN,
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    for complaint in complaints:
        assert complaint in raised.value.details()


@pytest.mark.service
async def test_an_override_naming_a_fifo_outside_the_folder_is_refused_and_later_loads_go_on(repo, tmp_path):
    """The issue's attack: the server opened what the override named, waited on
    the FIFO while holding the model's lock, and every later load of the model hung."""
    model_dir = repo / "mlp"
    outside, inside = tmp_path / "outside.fifo", model_dir / "inside.fifo"
    (model_dir / "escape.json").symlink_to(outside)
    (model_dir / "zero.json").symlink_to("/dev/zero")
    with fifos(outside, inside):
        async with model_server(repo) as server:
            await _refused(
                server, _golden(str(outside)), "field 'golden_probe.file'", str(outside), "is an absolute path"
            )
            await _refused(
                server, _golden("../outside.fifo"), "field 'golden_probe.file'", "'../outside.fifo'", "contains '..'"
            )
            await _refused(
                server,
                _golden("escape.json"),
                "field 'golden_probe.file'",
                "'escape.json'",
                f"resolves to {outside}, outside",
            )
            await _refused(server, _golden("inside.fifo"), "'inside.fifo'", "is a FIFO", "not a regular file")
            await _refused(server, _golden("/dev/zero"), "'/dev/zero'", "is an absolute path")
            await _refused(server, _golden("zero.json"), "'zero.json'", "resolves to /dev/zero, outside")
            await _refused(server, _golden("1"), "'1'", "is a directory")
            # The model's lock was never held past a refusal: the next load goes through at once.
            await server.oip.RepositoryModelLoad(
                oip.RepositoryModelLoadRequest(model_name="mlp"), timeout=ATTACK_TIMEOUT_S, metadata=ADMIN
            )
            assert await server.ready()
            assert (await server.execute())[0] == "1"


@pytest.mark.service
async def test_a_fifo_planted_as_the_golden_file_or_the_config_fails_the_load_without_waiting(repo):
    model_dir = repo / "mlp"
    (model_dir / "golden.json").unlink()
    with fifos(model_dir / "golden.json"):
        async with model_server(repo) as server:  # at startup: logged, the server still starts
            assert not await server.ready()
            await _refused(server, {}, "field 'golden_probe.file'", "is a FIFO")
    config = (model_dir / "config.json").read_text()
    (model_dir / "config.json").unlink()
    with fifos(model_dir / "config.json"), pytest.raises(ConfigError, match="the model's config is a FIFO"):
        load_config(model_dir)
    (model_dir / "config.json").write_text(config)


def _text_model(repo: pathlib.Path, tokenizer_file: str) -> pathlib.Path:
    """A text model's config (nothing is loaded: the checks come first)."""
    model_dir = repo / "text"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "name": "text",
                "platform": "onnxruntime_onnx",
                "max_batch_size": 8,
                "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 4]}],
                "preprocess": {"kind": "text_tokenizer", "tokenizer_file": tokenizer_file, "max_length": 16},
            }
        )
    )
    return model_dir


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, complaint",
    [
        ("/etc/passwd", "is an absolute path"),
        ("../../tokenizer.json", "contains '..'"),
        ("sub/../../x.json", "contains '..'"),
        ("", "is empty"),
        ("a\x00b", "holds a NUL character"),
    ],
)
def test_a_tokenizer_file_outside_the_version_folder_is_refused_by_name(tmp_path, name, complaint):
    with pytest.raises(ConfigError) as raised:
        load_config(_text_model(tmp_path, name))
    assert "field 'preprocess.tokenizer_file'" in str(raised.value) and complaint in str(raised.value)


@pytest.mark.unit
def test_a_tokenizer_file_that_resolves_outside_or_is_no_regular_file_is_refused(tmp_path):
    model_dir = _text_model(tmp_path, "tokenizer.json")
    tokenizer = model_dir / "1" / "tokenizer.json"
    tokenizer.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ConfigError, match=r"resolves to .*elsewhere\.json, outside"):
        load_config(model_dir)
    tokenizer.unlink()
    with (
        fifos(tokenizer),
        pytest.raises(ConfigError, match=r"'preprocess\.tokenizer_file' is 'tokenizer\.json', which is a FIFO"),
    ):
        load_config(model_dir)
    with open(tokenizer, "wb") as f:  # sparse: its size is what counts, checked before it is read
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(ConfigError, match=f"more than the {MAX_TOKENIZER_BYTES} it may hold"):
        load_config(model_dir)


@pytest.mark.unit
def test_a_version_folder_may_be_a_link_but_its_files_stay_inside_it(tmp_path):
    model_dir = _text_model(tmp_path, "tokenizer.json")
    store = tmp_path / "store" / "text-1"
    store.mkdir(parents=True)
    (store / "tokenizer.json").write_text("{}")
    (model_dir / "1").rmdir()
    (model_dir / "1").symlink_to(store, target_is_directory=True)
    assert load_config(model_dir).tokenizer_path("1") == (store / "tokenizer.json").resolve()


@pytest.mark.service
async def test_a_golden_file_too_large_is_refused_before_it_is_read(repo):
    with open(repo / "mlp" / "huge.json", "wb") as f:
        f.truncate(MAX_GOLDEN_BYTES + 1)
    async with model_server(repo) as server:
        await _refused(server, _golden("huge.json"), "'huge.json'", f"more than the {MAX_GOLDEN_BYTES} it may hold")


@pytest.mark.service
@pytest.mark.parametrize(
    "fields, complaint",
    [
        ({"warmup": {"batch_sizes": [1, 2, 3, 4, 5, 6, 7, 8, 9]}}, "expected 1 to 8 sizes in 1..max_batch_size"),
        ({"warmup": {"batch_sizes": []}}, "expected 1 to 8 sizes"),
        ({"max_batch_size": 4097}, "field 'max_batch_size' must be 1..4096, got 4097"),
        ({"max_batch_size": 10**12, "warmup": {"batch_sizes": [10**12]}}, "field 'max_batch_size' must be 1..4096"),
        ({"tp_degree": 1000}, "field 'tp_degree' must be 1..64, got 1000"),
        ({"instances": {"count": 65}}, "field 'count' must be 1..64, got 65"),
        ({"instances": {"gpus": list(range(65))}}, "expected a list of 1..64 device ids"),
        (
            {"preprocess": {"kind": "text_tokenizer", "tokenizer_file": "t.json", "max_length": 32769}},
            "field 'max_length' must be 2..32768, got 32769",
        ),
        ({"fallback": "../elsewhere"}, "field 'fallback' is '../elsewhere'; name another model"),
    ],
)
async def test_sizes_an_override_asks_for_are_bounded(repo, fields, complaint):
    async with model_server(repo) as server:
        await _refused(server, fields, complaint)
        assert await server.ready()  # the version serving before still serves


@pytest.mark.service
async def test_an_overrides_document_past_its_bound_is_refused_before_it_is_parsed(repo):
    async with model_server(repo) as server:
        padding = "x" * MAX_OVERRIDES_BYTES
        await _refused(server, {"fallback": padding}, "parameter 'config' is", f"at most {MAX_OVERRIDES_BYTES}")


@pytest.mark.unit
def test_reading_a_checked_file_never_waits_on_a_fifo_put_in_its_place(tmp_path):
    """Between the check and the read a file may be swapped for a FIFO: the
    read opens it without blocking and refuses it once open."""
    with fifos(tmp_path / "swapped.json"), pytest.raises(ConfigError, match="is a FIFO"):
        read_bounded(tmp_path / "swapped.json", 1024, "golden_probe.file")
