"""PyTorch's DDP tutorial job, as DDP users run it: plain torch DDP, no hvdp.

pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py, started the way its README
starts it: ``torchrun --standalone --nproc_per_node 2 ddp_tutorial.py TOTAL_EPOCHS SAVE_EVERY``.
Changed only where a CPU test needs it: the Gloo backend and no device moves; a fixed
``torch.manual_seed(0)`` before the data and the model, so its port builds the same ones; the MSE
loss (the tutorial's ``F.cross_entropy`` of one output is 0 whatever the weights, so nothing would
train); no resume from a snapshot; the snapshot and every rank's final weights
(``rank{RANK}.json``) written to the folder in $HVDP_TEST_OUT. Its port to hvdp, row by row with
docs/porting.md, is ddp_tutorial_hvdp.py.
"""

import json
import os

import torch
import torch.nn.functional as F  # noqa: N812 (the tutorial's names)
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OUT = os.environ["HVDP_TEST_OUT"]
SNAPSHOT = os.path.join(OUT, "snapshot.pt")


class MyTrainDataset(Dataset):  # the tutorial's datautils.py
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.model = DDP(self.model)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[rank {self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)
    train_set = MyTrainDataset(2048)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path=SNAPSHOT):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    start = {name: value.flatten().tolist() for name, value in model.state_dict().items()}
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    weights = {name: value.flatten().tolist() for name, value in trainer.model.module.state_dict().items()}
    with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as out:
        json.dump({"rank": trainer.global_rank, "start": start, "weights": weights}, out)
    # Not in the tutorial: every rank waits here for the others before Gloo's group is torn down (once, on a
    # loaded machine, rank 1 aborted in the teardown while rank 0 was still finishing its last step: "terminate
    # called without an active exception", torch 2.13's ProcessGroupGloo).
    torch.distributed.barrier()
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size)
