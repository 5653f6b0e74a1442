import pytest

from tests.e2e.cluster import Cluster


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("glm53-cache")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("cluster"), model_cache).start()
    yield c
    c.stop()
