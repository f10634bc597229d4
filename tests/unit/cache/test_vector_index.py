import math

import numpy as np
import pytest

from sidecar.cache.vector_index import VectorIndex, as_unit, hamming_radius

DIM = 384


def unit(rng, n, dim=DIM):
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def near(rng, v, cosine):
    """A unit vector at exactly `cosine` to unit vector `v`."""
    noise = rng.standard_normal(v.shape[0]).astype(np.float32)
    noise -= noise.dot(v) * v
    noise /= np.linalg.norm(noise)
    return (cosine * v + math.sqrt(1 - cosine ** 2) * noise).astype(np.float32)


def exact_best(matrix, q):
    scores = matrix @ q
    i = int(np.argmax(scores))
    return i, float(scores[i])


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_empty_index_finds_nothing(rng):
    assert VectorIndex().search(unit(rng, 1)[0], 0.0) is None


def test_finds_the_nearest_and_its_exact_similarity(rng):
    index = VectorIndex()
    vectors = unit(rng, 50)
    for i, v in enumerate(vectors):
        index.add(f"k{i}", v)
    q = near(rng, vectors[17], 0.95)
    key, similarity = index.search(q, 0.9)
    assert key == "k17"
    assert similarity == pytest.approx(0.95, abs=1e-5)


def test_threshold_is_inclusive_and_below_it_is_a_miss(rng):
    index = VectorIndex()
    v = unit(rng, 1)[0]
    index.add("a", v)
    q = near(rng, v, 0.85)
    assert index.search(q, 0.86) is None
    assert index.search(q, 0.849)[0] == "a"


def test_add_replaces_the_vector_of_a_key(rng):
    index = VectorIndex()
    a, b = unit(rng, 2)
    index.add("k", a)
    index.add("k", b)
    assert len(index) == 1
    assert index.search(b, 0.99)[0] == "k"
    assert index.search(a, 0.99) is None


def test_discard_moves_the_last_row_into_the_hole(rng):
    index = VectorIndex()
    vectors = unit(rng, 3)
    for i, v in enumerate(vectors):
        index.add(f"k{i}", v)
    assert index.discard("k0")
    assert not index.discard("k0")
    assert "k0" not in index and len(index) == 2
    assert index.search(vectors[0], 0.9) is None
    assert index.search(vectors[2], 0.99)[0] == "k2"
    assert index.search(vectors[1], 0.99)[0] == "k1"


def test_grows_and_shrinks_geometrically(rng):
    index = VectorIndex()
    vectors = unit(rng, 1000)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    assert index.capacity == 1024
    for i in range(990):
        index.discard(str(i))
    assert index.capacity <= 64
    for i in range(990, 1000):
        assert index.search(vectors[i], 0.99)[0] == str(i)


def test_vectors_are_normalised_and_bad_ones_rejected(rng):
    index = VectorIndex(dim=4)
    index.add("a", np.array([3.0, 0, 0, 0]))
    key, similarity = index.search(np.array([1.0, 0, 0, 0]), 0.5)
    assert (key, similarity) == ("a", pytest.approx(1.0))
    with pytest.raises(ValueError, match="4 dimensions"):
        index.add("b", np.ones(5))
    with pytest.raises(ValueError, match="non-zero"):
        as_unit(np.zeros(4), 4)


@pytest.mark.parametrize("similarity, radius", [(1.0, 0), (0.9, 97), (0.8, 127), (-1.0, 384)])
def test_hamming_radius(similarity, radius):
    assert hamming_radius(similarity, 384) == radius


def test_prefilter_path_agrees_with_exact_search(rng):
    """Above exact_max the sign-bit prefilter must find what an exact scan finds."""
    vectors = unit(rng, 3000)
    index = VectorIndex(exact_max=100)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    for target in rng.integers(0, 3000, 60):
        cosine = float(rng.uniform(0.8, 0.99))
        q = near(rng, vectors[target], cosine)
        best, similarity = exact_best(vectors, q)
        found = index.search(q, 0.8)
        assert found is not None and found[0] == str(best)
        assert found[1] == pytest.approx(similarity, abs=1e-5)
    for q in unit(rng, 30):  # nothing near: both say miss
        assert index.search(q, 0.8) is None


def test_prefilter_caps_the_candidates_it_scores(rng):
    """A threshold so low that every row is a candidate still finds a near duplicate."""
    vectors = unit(rng, 2000)
    index = VectorIndex(exact_max=10, max_candidates=64)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    q = near(rng, vectors[5], 0.97)
    assert index.search(q, -1.0)[0] == "5"


def test_prefilter_survives_discards(rng):
    vectors = unit(rng, 500)
    index = VectorIndex(exact_max=10)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    for i in range(0, 500, 2):
        index.discard(str(i))
    for i in (1, 251, 499):
        assert index.search(vectors[i], 0.99)[0] == str(i)
    assert index.search(vectors[250], 0.99) is None


def test_dimension_not_a_multiple_of_64(rng):
    vectors = unit(rng, 200, dim=100)
    index = VectorIndex(dim=100, exact_max=0)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    assert index.search(near(rng, vectors[9], 0.95), 0.9)[0] == "9"


def test_an_index_holds_rows_for_its_vectors_only(rng):
    """A cache may hold many scopes of one entry each: each must cost about its one row."""
    index = VectorIndex()
    assert index.capacity == 0 and index.nbytes == 0 and index.search(unit(rng, 1)[0], 0.5) is None
    v = unit(rng, 1)[0]
    index.add("k", v)
    assert index.capacity == 1 and index.nbytes < 1.1 * 384 * 4
    assert index.search(v, 0.99)[0] == "k"
    index.discard("k")
    assert index.capacity == 0 and index.nbytes == 0
