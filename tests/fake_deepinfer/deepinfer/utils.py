import os


def get_distributed_init_method(parallel_config) -> str:
    ip = os.getenv("MASTER_ADDR", "localhost")
    port = str(int(os.getenv("MASTER_PORT", "23333")) - 50)
    return f"tcp://{ip}:{int(port) + parallel_config.engine_group_rank}"
