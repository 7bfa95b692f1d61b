import msgspec
import pytest

from pipeline.errors import StageError
from pipeline.settings import BackendSettings, Settings
from pipeline.stages.route import RouteStage
from tests.unit.fakes import run_handler
from tests.unit.helpers import request, routed
from topics.errors import ErrorCode


@pytest.mark.asyncio
async def test_sends_to_the_pool_of_the_backend_serving_the_model() -> None:
    settings = Settings(backends=(BackendSettings("a", "m1", "pool-a"), BackendSettings("b", "m1", "pool-b"), BackendSettings("c", "m2", "pool-c")))
    envelope = msgspec.structs.replace(routed(request(model="m1")), route=None)
    [out] = await run_handler(RouteStage(settings), envelope)
    assert out.topic == "llm.routed.pool-a"
    assert out.value.route.backend == "a" and out.value.route.fallbacks == ("b",)
    assert set(out.value.timings) == {"ingest", "route"}


@pytest.mark.asyncio
async def test_an_unserved_model_is_not_found() -> None:
    with pytest.raises(StageError) as caught:
        await run_handler(RouteStage(Settings()), routed(request(model="other")))
    assert caught.value.code is ErrorCode.not_found
