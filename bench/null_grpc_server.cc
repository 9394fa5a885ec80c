// A gRPC server that does no work: every call on any method is answered OK with the same bytes,
// whatever it was sent. //bench:triton runs it (--null-server) to measure what the load
// generator reaches on this machine against a server that costs nothing: the ceiling of every
// throughput ratio the bench reports. C++ on gRPC's async API with one completion queue per
// thread, as Triton's own gRPC front is built.
//
//   null_grpc_server PORT RESPONSE_FILE [THREADS]
//
// Built by the bench with g++ and pkg-config's grpc++ (Debian: libgrpc++-dev).
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string g_response;

// One call: requested, then read, then answered; each step's completion drives the next.
class Call {
 public:
  Call(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq)
      : service_(service), cq_(cq), stream_(&ctx_) {
    service_->RequestCall(&ctx_, &stream_, cq_, cq_, this);
  }

  void Proceed(bool ok) {
    switch (state_) {
      case State::kRequested:
        new Call(service_, cq_);  // the next call is awaited before this one is served
        if (!ok) {
          delete this;
          return;
        }
        state_ = State::kRead;
        stream_.Read(&request_, this);
        return;
      case State::kRead: {
        state_ = State::kAnswered;
        grpc::Slice slice(g_response);
        grpc::ByteBuffer response(&slice, 1);
        stream_.WriteAndFinish(response, grpc::WriteOptions(), grpc::Status::OK, this);
        return;
      }
      case State::kAnswered:
        delete this;
        return;
    }
  }

 private:
  enum class State { kRequested, kRead, kAnswered };
  grpc::AsyncGenericService* service_;
  grpc::ServerCompletionQueue* cq_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_;
  grpc::ByteBuffer request_;
  State state_ = State::kRequested;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: null_grpc_server PORT RESPONSE_FILE [THREADS]\n";
    return 2;
  }
  std::ifstream file(argv[2], std::ios::binary);
  if (!file) {
    std::cerr << "cannot read " << argv[2] << "\n";
    return 2;
  }
  std::stringstream bytes;
  bytes << file.rdbuf();
  g_response = bytes.str();
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;

  grpc::AsyncGenericService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials(), &port);
  builder.RegisterAsyncGenericService(&service);
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  for (int i = 0; i < threads; ++i) queues.push_back(builder.AddCompletionQueue());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "cannot listen on 127.0.0.1:" << argv[1] << "\n";
    return 1;
  }
  std::cout << "listening on 127.0.0.1:" << port << std::endl;
  std::vector<std::thread> workers;
  for (auto& queue : queues) {
    grpc::ServerCompletionQueue* cq = queue.get();
    for (int k = 0; k < 64; ++k) new Call(&service, cq);
    workers.emplace_back([cq] {
      void* tag;
      bool ok;
      while (cq->Next(&tag, &ok)) static_cast<Call*>(tag)->Proceed(ok);
    });
  }
  for (auto& worker : workers) worker.join();
  return 0;
}
