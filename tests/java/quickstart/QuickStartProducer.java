import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.common.message.Message;

public class QuickStartProducer {
    public static void main(String[] args) throws Exception {
        DefaultMQProducer producer = new DefaultMQProducer("quickstart-producer");
        producer.setNamesrvAddr(System.getProperty("namesrv", "127.0.0.1:9876"));  // txmq's --remoting-port
        producer.start();
        for (int i = 0; i < 3; i++) {
            Message msg = new Message("quickstart", "TagA", ("Hello txmq " + i).getBytes("UTF-8"));
            SendResult result = producer.send(msg);
            System.out.printf("%s %s%n", result.getSendStatus(), result.getMsgId());
        }
        producer.shutdown();
    }
}
