# DeepInfer-server image: DeepInfer (built from source) + deepseek-recipe + this project's wheel.
#
#   docker build --build-arg MAX_JOBS=8 -t deepinfer-server:latest .
#   docker build --build-arg MAX_JOBS=8 --build-arg FLASH_MLA_SKIP_REG_SPILL_CHECK=1 -t deepinfer-server:latest .
#
# Stages:
#   wheel   Rust toolchain (rustup) + maturin; builds the deepinfer-server wheel (abi3) from the repo root.
#   final   CUDA 13.2.0 devel (nvcc etc. stay for kernel JIT), Python 3.12 venv, DeepInfer at a pinned commit,
#           deepseek-recipe 0.2.0, the wheel, and a `pip check` gate.

ARG CUDA_IMAGE=nvidia/cuda:13.2.0-devel-ubuntu24.04

# ---------------------------------------------------------------------------------------------------------------
# Stage 1: build this project's wheel. The Rust toolchain lives only here.
# ---------------------------------------------------------------------------------------------------------------
FROM ubuntu:24.04 AS wheel

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential ca-certificates curl pkg-config python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

ENV RUSTUP_HOME=/opt/rustup \
    CARGO_HOME=/opt/cargo \
    PATH=/opt/cargo/bin:/opt/maturin/bin:${PATH}
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
        | sh -s -- -y --no-modify-path --profile minimal --default-toolchain stable \
    && rustc --version && cargo --version

RUN python3.12 -m venv /opt/maturin \
    && /opt/maturin/bin/pip install --no-cache-dir maturin==1.16.0

WORKDIR /src
# Cargo.lock and README.md are optional here (the glob lets COPY succeed without them).
COPY pyproject.toml Cargo.toml Cargo.lock* README.md* ./
COPY rust ./rust
COPY python ./python
RUN maturin build --release --interpreter python3.12 --out /wheels \
    && ls -l /wheels

# ---------------------------------------------------------------------------------------------------------------
# Stage 2: runtime image (keeps the CUDA devel toolchain: DeepGEMM/DeepEP/TileLang compile kernels at run time).
# ---------------------------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS final

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Parallel compile jobs for the DeepInfer / kernel builds.
ARG MAX_JOBS=8
# Set to 1 to skip FlashMLA's post-build register-spill check (upstream override; off by default).
ARG FLASH_MLA_SKIP_REG_SPILL_CHECK=0
# SM100 (B200/GB200/B300) is the only NVIDIA target DeepInfer supports; no GPU is visible during docker build.
ARG TORCH_CUDA_ARCH_LIST=10.0
ARG DEEPINFER_REPO=https://github.com/deepseek-ai/DeepInfer.git
ARG DEEPINFER_COMMIT=9bd9cf243fc53ef9afbf8f04d391d989117d6ab9
ARG DEEPSEEK_RECIPE_VERSION=0.2.0

ENV DEBIAN_FRONTEND=noninteractive \
    DEEPINFER_ACCELERATOR=nvidia \
    DEEPINFER_SERVER_ENGINE=deepinfer \
    CUDA_HOME=/usr/local/cuda \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONPATH=/opt/DeepInfer \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEEPINFER_JIT_CACHE_DIR=/cache/jit \
    HF_HOME=/cache/huggingface

# Build tools stay in the final image on purpose (runtime JIT needs a host compiler next to nvcc).
# rdma-core / libibverbs: DeepEP and Engram talk to the NICs exposed with --device=/dev/infiniband.
# libmimalloc2.0: the server preloads it (--malloc auto); the GPU ranks keep glibc malloc.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential ca-certificates cmake git ninja-build pkg-config \
        python3.12 python3.12-dev python3.12-venv \
        ibverbs-providers libibverbs-dev librdmacm-dev rdma-core libnuma-dev \
        libmimalloc2.0 \
    && rm -rf /var/lib/apt/lists/*

# Python 3.12 virtual environment (Ubuntu 24.04's system Python is externally managed, PEP 668).
# hadolint ignore=DL3013
RUN python3.12 -m venv /opt/venv \
    && pip install --no-cache-dir --upgrade pip setuptools wheel

# DeepInfer from source at the pinned commit (with its vendored kernel libraries as submodules).
WORKDIR /opt/DeepInfer
RUN git clone "${DEEPINFER_REPO}" /opt/DeepInfer \
    && git checkout "${DEEPINFER_COMMIT}" \
    && git submodule update --init --recursive \
    && test "$(git rev-parse HEAD)" = "${DEEPINFER_COMMIT}"

# Python requirements, then the build (DeepInfer, DeepGEMM, DeepEP, FlashMLA, DeepSelect). The spill-check
# override reaches the build only when explicitly set to 1 (build args are visible as environment variables in
# RUN, so the variable is unset first; upstream could treat any non-empty value, even "0", as set).
RUN skip_spill="${FLASH_MLA_SKIP_REG_SPILL_CHECK}" \
    && unset FLASH_MLA_SKIP_REG_SPILL_CHECK \
    && if [ -f requirements-nvidia.txt ]; then pip install --no-cache-dir -r requirements-nvidia.txt; fi \
    && if [ -f requirements.txt ]; then pip install --no-cache-dir -r requirements.txt; fi \
    && spill_env="" \
    && if [ "${skip_spill}" = "1" ]; then \
           echo "WARNING: FLASH_MLA_SKIP_REG_SPILL_CHECK=1: FlashMLA register-spill check skipped"; \
           spill_env="FLASH_MLA_SKIP_REG_SPILL_CHECK=1"; \
       fi \
    && if [ -f build.sh ]; then \
           env MAX_JOBS="${MAX_JOBS}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" ${spill_env:+"${spill_env}"} \
               bash build.sh; \
       else \
           env MAX_JOBS="${MAX_JOBS}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" ${spill_env:+"${spill_env}"} \
               pip install --no-cache-dir --no-build-isolation -v .; \
       fi \
    && rm -rf /root/.cache

# deepseek-recipe (chat template / tool-call codec) and this project's wheel.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir "deepseek-recipe==${DEEPSEEK_RECIPE_VERSION}" \
    && pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import deepinfer_server, deepinfer_server._native"

# Dependency gate: any `pip check` finding fails the build, except DeepInfer's intentional NCCL override of
# torch's pin (nvidia-nccl-cu13 2.32.3 installed, torch pins 2.29.7). Only that exact line is tolerated.
RUN allowed='^torch [^ ]+ has requirement nvidia-nccl-cu13==2\.29\.7( *;[^,]*)?, but you have nvidia-nccl-cu13 2\.32\.3\.$'; \
    set +e; \
    report="$(pip check 2>&1)"; status=$?; \
    set -e; \
    echo "${report}"; \
    if [ "${status}" -eq 0 ]; then exit 0; fi; \
    remaining="$(printf '%s\n' "${report}" | grep -v -E "${allowed}" | grep -v -E '^[[:space:]]*$' || true)"; \
    if [ -n "${remaining}" ] || ! printf '%s\n' "${report}" | grep -q -E "${allowed}"; then \
        echo "pip check failed (exit ${status}); conflicts other than the allowed NCCL override:" >&2; \
        echo "${remaining:-<no output>}" >&2; \
        exit 1; \
    fi; \
    echo "pip check: only DeepInfer's intentional nvidia-nccl-cu13 2.32.3 override of torch's 2.29.7 pin"

# The server runs as an unprivileged user (uid 1001, group 0 as OpenShift and GPUStack's runtime GID conventions
# expect). /cache holds JIT artifacts (/cache/jit) and Hugging Face downloads, remote code included
# (/cache/huggingface): what is there runs inside the server, so it belongs to that user and its group, and is not
# world-writable (setgid: new files keep the group). A runtime UID of its own (GPUSTACK_MODEL_RUNTIME_UID, Kubernetes
# runAsUser) needs group 0 or a volume it owns (docs/deploy.md).
RUN useradd --system --uid 1001 --gid 0 --home-dir /cache --no-create-home --shell /usr/sbin/nologin deepinfer \
    && mkdir -p /cache/jit /cache/huggingface \
    && chown -R 1001:0 /cache \
    && chmod -R u=rwX,g=rwX,o= /cache \
    && find /cache -type d -exec chmod g+s {} +
VOLUME ["/cache"]

COPY docker/entrypoint.sh /usr/local/bin/deepinfer-entrypoint.sh
RUN chmod 0755 /usr/local/bin/deepinfer-entrypoint.sh

WORKDIR /
EXPOSE 8000
# The entrypoint execs the server, so it is PID 1 and takes `docker stop`'s SIGTERM itself: it stops admitting,
# drains for up to --drain-timeout (30 s) and exits 0, or 1 if the drain cut requests. Rank processes ignore SIGTERM
# and sit in their own process groups, so `docker run --init` (tini -g) or dumb-init signalling the group drains the
# same way. Give the container longer than the drain to stop (`docker stop -t 35`, `docker run --stop-timeout 35`,
# Kubernetes terminationGracePeriodSeconds: 35); Docker's default of 10 s SIGKILLs a longer drain.
STOPSIGNAL SIGTERM
# Unprivileged: RDMA needs the devices (--device=/dev/infiniband, readable by all with rdma-core's udev rules) and
# an unlimited locked-memory limit given by the runtime (--ulimit memlock=-1), not root (docs/deploy.md).
USER 1001:0
ENTRYPOINT ["/usr/local/bin/deepinfer-entrypoint.sh"]
