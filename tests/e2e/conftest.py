import pytest

from glm53.support.cluster import Cluster


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("glm53-cache")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    # Decode batches token events in twos here (stream_interval), one by one in test_faults.
    # The tool-call parser changes nothing for requests without tools (structured_checks.py).
    c = Cluster(tmp_path_factory.mktemp("cluster"), model_cache, stream_interval=2,
                router={"tool_call_parser": "glm47"}).start()
    yield c
    c.stop()
