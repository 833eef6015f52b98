# One H200 (nvidia-h200): a rank failing while the mesh's graph is captured (every rank raises,
# the capture ends, the next generate captures anew and gives HF's tokens), then the joint-graph
# tests once more (a second fresh seed). Logs under $OUT/logs.
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/logs/device.txt
date -u +%F | tee -a $OUT/logs/device.txt
timeout 500 python -m pytest tests/test_cuda_graph.py -k "failing_while_the_mesh_graph or one_graph_replays_every_rank" \
  -o addopts="" -q -p no:cacheprovider -p no:logging -p no:benchmark -rfEs --durations=5 -n 4 2>&1 | tail -25 \
  | grep -v "^bringing up nodes" | tee $OUT/logs/gpu_tests_mesh_graph_again.log
