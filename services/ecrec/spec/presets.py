"""Model presets and the dataset shapes they encode: what `model.preset` fills in when a field is left unset.

Pure data (camelCase keys, as in YAML); `ModelSpec` applies a preset, the CRD leaves the fields a preset may
fill without a default, and tests/test_movielens.py checks the MovieLens-100k shape against its loader.
"""

from __future__ import annotations

from typing import Any, Literal

# The 26 Criteo Kaggle (Display Advertising Challenge) cardinalities, in column order C1..C26.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Capped so that the x8 scale still fits in this machine's 24 GiB with optimizer state and parity.
CRITEO_TABLE_CAP = 100_000
# MovieLens-100k as ecrec.movielens reads it (data.source: movielens100k): rows of its tables user, movie,
# primary genre, age bucket, gender, occupation, zip prefix, release decade; and its dense features (age,
# release year, number of genres, log earlier ratings of the user and of the movie). tests/test_movielens.py
# checks them against what the loader computes from the files.
MOVIELENS100K_TABLE_SIZES: tuple[int, ...] = (943, 1682, 19, 7, 2, 21, 382, 9)
MOVIELENS100K_NUM_DENSE = 5

# Values a preset fills in when the user leaves the field unset (camelCase keys, as in YAML).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "tableSizes": [1000, 500, 2000, 800],
        "embeddingDim": 8,
        "bottomMlp": [16, 8],
        "topMlp": [16, 1],
    },
    "small": {
        # Deliberately uneven and unsorted, like real categorical features.
        "tableSizes": [1200, 3000, 50000, 8000, 25000, 1000, 15000, 4000],
        "embeddingDim": 16,
        "bottomMlp": [64, 16],
        "topMlp": [64, 1],
    },
    "criteo-kaggle": {
        "tableSizes": [min(n, CRITEO_TABLE_CAP) for n in CRITEO_KAGGLE_CARDINALITIES],
        "embeddingDim": 16,
        "bottomMlp": [512, 256, 64, 16],
        "topMlp": [512, 256, 1],
    },
    "movielens100k": {
        # The tables and dense features of data.source: movielens100k; any other shape is refused with it.
        "tableSizes": list(MOVIELENS100K_TABLE_SIZES),
        "numDenseFeatures": MOVIELENS100K_NUM_DENSE,
        "embeddingDim": 16,
        "bottomMlp": [32, 16],
        "topMlp": [64, 1],
    },
}
PresetName = Literal["tiny", "small", "criteo-kaggle", "movielens100k"]
