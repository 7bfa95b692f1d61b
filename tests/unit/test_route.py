import pytest

from pipeline.errors import StageError
from pipeline.settings import BackendSettings, Settings
from pipeline.stages.route import RouteStage
from pipeline.topology import graph
from tests.unit.fakes import run_handler
from tests.unit.helpers import admitted, request
from topics.errors import ErrorCode
from topics.hops import Routed


def route_stage(settings: Settings) -> RouteStage:
    [node] = [n for n in graph(settings.stages, settings.pools) if n.kind == "route"]
    return RouteStage(settings, node.topics)


@pytest.mark.asyncio
async def test_sends_to_the_pool_of_the_backend_serving_the_model() -> None:
    settings = Settings(backends=(BackendSettings("a", "m1", "pool-a"), BackendSettings("b", "m1", "pool-b"), BackendSettings("c", "m2", "pool-c")))
    [out] = await run_handler(route_stage(settings), admitted(request(model="m1")))
    assert isinstance(out.value, Routed) and out.key == "default/r1"
    route = out.value.route  # with no health reported yet, either backend of the model, the other behind it
    assert {route.backend, *route.fallbacks} == {"a", "b"} and out.topic == f"llm.routed.pool-{route.backend}"
    assert set(out.value.timings) == {"ingest", "route"}


@pytest.mark.asyncio
async def test_an_unserved_model_is_not_found() -> None:
    with pytest.raises(StageError) as caught:
        await run_handler(route_stage(Settings()), admitted(request(model="other")))
    assert caught.value.code is ErrorCode.not_found
