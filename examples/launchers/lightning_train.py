"""The same model as a LightningModule, trained by Lightning's Trainer with DDP.

Lightning starts the other processes itself: run this script ONCE per node and
Trainer(devices=N) spawns local ranks 1..N-1 as copies of the same command.
Across nodes it reads MASTER_ADDR, MASTER_PORT and NODE_RANK (and computes
WORLD_SIZE = devices x num_nodes).  Under torchrun it detects torchelastic
and lets torchrun own the processes instead (devices must then equal
--nproc-per-node).

    # one machine, 2 processes (CPU here; --accelerator gpu --devices 8 on a GPU box):
    python examples/launchers/lightning_train.py --devices 2

    # two nodes, on each (NODE_RANK=0 on the first, 1 on the second):
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 \
        python examples/launchers/lightning_train.py --devices 2 --num-nodes 2

    # or under torchrun:
    torchrun --nproc-per-node 2 examples/launchers/lightning_train.py --devices 2

    corral run --launcher lightning examples/launchers/lightning_train.py --devices 2
"""

import argparse
import gc

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        self.first_loss: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.first_loss is None:
            self.first_loss = loss.detach()
        # on_epoch + sync_dist: one all-reduce per epoch, not per step
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def on_train_epoch_end(self):
        self.print(
            f"epoch {self.current_epoch} | loss {self.trainer.callback_metrics['train_loss']:.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    # Synthetic regression: the same data everywhere; Lightning adds the DistributedSampler.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(4096, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

    model = Regressor()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_epochs=args.epochs,
        logger=False,  # no lightning_logs/ directory for an example
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # epoch lines instead; a bar per epoch adds nothing here
    )
    trainer.fit(model, loader)

    first = trainer.strategy.reduce(model.first_loss, reduce_op="mean")  # every rank calls it
    final = trainer.callback_metrics["train_loss"]  # the last epoch's mean, synced over ranks
    if trainer.is_global_zero:
        print(f"first loss {first.item():.4f} | final loss {final.item():.4f}", flush=True)
    # Lightning closes NCCL groups at exit but leaves gloo ones open, and its DDP-wrapped
    # model keeps the group alive: a gloo thread still running at interpreter exit can
    # abort it ("terminate called without an active exception").  Release, then destroy.
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
