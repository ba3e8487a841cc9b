# cgad-node: one image for every role (bootstrap, worker); the command picks the role.
# BASE_IMAGE: any image with Python 3.11+ and pip on PATH. Where the registry's python:3.11-slim
# cannot be pulled, `make compose-up` makes a local one from Debian's packages
# (deploy/make_base_image.sh) and passes it here.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

WORKDIR /opt/cgad-node
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU build of torch keeps the image small; for NVIDIA GPUs install the CUDA build instead
# (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128). A base that
# already has torch 2.13.0 (the local one does) satisfies this step without a download.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# the dependencies in a layer of their own, so that a change to the code rebuilds only the last step
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        >/tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY node ./node
COPY protocol ./protocol
COPY optim ./optim
# the benchmarks install with the package (cgad.bench); their results stay out of the image
COPY bench ./bench
RUN pip install --no-cache-dir --no-deps .

# the tokenizer and token caches live on a volume, so a restart does not rebuild them
ENV CGAD_CACHE_DIR=/cache
VOLUME ["/cache", "/checkpoints"]
EXPOSE 31337 31338 7780 7781 9100
ENTRYPOINT ["cgad-node"]
CMD ["--help"]
