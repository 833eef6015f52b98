# One H200 (nvidia-h200): the decode steps of every rank of a SimulatedMesh replayed from one CUDA
# graph (runtime/joint_graph.py), tp 2 for the six families and tp 4 for Mamba-2 and Zamba2, on the
# current plan (every decode pass, the Triton kernels); then the GPU tests a mesh now graphs in
# (short prompts at tp 2, TSP prefill into graphed decode) and the tp-1 graphed decode tests
# (GraphedDecode shares its capture code with the joint graph). Logs under $OUT/logs.
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/logs/device.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/logs/device.txt
date -u +%F | tee -a $OUT/logs/device.txt
run() {  # log name, time limit, pytest arguments
  local log=$1 limit=$2; shift 2
  timeout $limit python -m pytest "$@" -o addopts="" -q -p no:cacheprovider -p no:logging -rfEs --durations=5 -n 4 \
    2>&1 | tail -25 | tee -a $OUT/logs/$log
}
run gpu_tests_mesh_graph.log 240 tests/test_cuda_graph.py -k one_graph_replays_every_rank
run gpu_tests_mesh_generate.log 150 tests/test_simulated_mesh.py tests/test_tsp_gpu.py -k "gpu_mesh or generate_on_the_gpu"
run gpu_tests_graphed_decode_tp1.log $((${TOTAL_LIMIT:-580} - SECONDS)) tests/test_cuda_graph.py tests/test_finishing_rows.py \
  -k "not one_graph_replays_every_rank"
