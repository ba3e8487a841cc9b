# cgad-node: one image for every role (bootstrap, worker); the command picks the role.
FROM python:3.11-slim

WORKDIR /opt/cgad-node
# The CPU build of torch keeps the image small; for NVIDIA GPUs install the CUDA build instead
# (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128).
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY optim ./optim
RUN pip install --no-cache-dir .

# the tokenizer and token caches live on a volume, so a restart does not rebuild them
ENV CGAD_CACHE_DIR=/cache
VOLUME ["/cache", "/checkpoints"]
EXPOSE 31337 31338 7780 9100
ENTRYPOINT ["cgad-node"]
CMD ["--help"]
